//! cargo-fuzz entry for [`kvroute_fuzz::filter_plan`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::filter_plan(data));
