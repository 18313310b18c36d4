//! vLLM ZMQ payload and sequence frames: any bytes decode to a batch or an error, never a panic.
#![no_main]

use kvroute_protocol::vllm::{decode_batch, decode_seq};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode_seq(data);
    let _ = decode_batch(data);
});
