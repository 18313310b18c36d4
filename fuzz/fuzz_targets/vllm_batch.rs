//! cargo-fuzz entry for [`kvroute_fuzz::vllm_batch`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::vllm_batch(data));
