//! cargo-fuzz entry for [`kvroute_fuzz::llm_request`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::llm_request(data));
