//! cargo-fuzz entry for [`kvroute_fuzz::response_usage`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::response_usage(data));
