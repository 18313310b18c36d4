//! cargo-fuzz entry for [`kvroute_fuzz::dynamo_zmq_message`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute_fuzz::dynamo_zmq_message(data));
