//! The floor under any proxy-wasm filter that reads a request's body, as `make bench-datapath`'s
//! `wasm_floor` setups run it: Envoy creates a context per request and enters the VM for each of
//! its callbacks, the request waits until its body is in, and the body is copied into the VM.
//! Nothing is parsed and nothing is asked, so the filter's own work is whatever kvroute costs
//! beyond this (docs/benchmarks.md, "Data path cost"). With `"floor_host_calls": N` in its
//! configuration it also reads a request header N times once the body is in: what a host call
//! costs. Built with the same SDK and target as the filter; not shipped.

/// The number after `"floor_host_calls":` in the plugin configuration (0 without one).
pub fn host_calls(config: &[u8]) -> u32 {
    const KEY: &[u8] = b"\"floor_host_calls\":";
    let Some(at) = config.windows(KEY.len()).position(|w| w == KEY) else {
        return 0;
    };
    config[at + KEY.len()..]
        .iter()
        .skip_while(|b| b.is_ascii_whitespace())
        .take_while(|b| b.is_ascii_digit())
        .fold(0u32, |n, &d| {
            n.saturating_mul(10).saturating_add(u32::from(d - b'0'))
        })
}

#[cfg(target_arch = "wasm32")]
mod floor {
    use proxy_wasm::hostcalls;
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, BufferType, ContextType, MapType};

    proxy_wasm::main! {{
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root { calls: 0 }) });
    }}

    struct Root {
        calls: u32,
    }

    impl Context for Root {}

    impl RootContext for Root {
        fn on_configure(&mut self, size: usize) -> bool {
            if let Ok(Some(config)) =
                hostcalls::get_buffer(BufferType::PluginConfiguration, 0, size)
            {
                self.calls = super::host_calls(&config);
            }
            true
        }

        fn create_http_context(&self, _: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Request { calls: self.calls }))
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    struct Request {
        calls: u32,
    }

    impl Context for Request {}

    impl HttpContext for Request {
        fn on_http_request_headers(&mut self, _: usize, end_of_stream: bool) -> Action {
            if end_of_stream {
                Action::Continue
            } else {
                Action::Pause
            }
        }

        fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
            if !end_of_stream {
                return Action::Pause;
            }
            let body = hostcalls::get_buffer(BufferType::HttpRequestBody, 0, body_size);
            std::hint::black_box(body).ok();
            for _ in 0..self.calls {
                let path = hostcalls::get_map_value(MapType::HttpRequestHeaders, ":path");
                std::hint::black_box(path).ok();
            }
            Action::Continue
        }
    }
}

#[cfg(test)]
mod tests {
    use super::host_calls;

    #[test]
    fn reads_the_host_calls_from_the_configuration() {
        assert_eq!(host_calls(br#"{"hints":false,"floor_host_calls": 20}"#), 20);
        assert_eq!(host_calls(br#"{"floor_host_calls":3,"x":1}"#), 3);
        assert_eq!(host_calls(br#"{"hints":false}"#), 0);
        assert_eq!(host_calls(b""), 0);
    }
}
