//! Dynamo NATS bodies (envelopes, JetStream JSON, kv_metrics): a decode or an error, never a panic.
#![no_main]

use kvroute_protocol::dynamo::{decode_kv_metrics, decode_message};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode_message(data);
    let _ = decode_kv_metrics(data);
});
