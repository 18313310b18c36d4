//! cargo-fuzz entry for [`kvroute_fuzz::chat_template`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::chat_template(data));
