//! The sidecar's binary inputs from the filter: hint requests and finished reports.
#![no_main]

use kvroute_protocol::hint::{decode_finished, HintRequest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = HintRequest::decode(data);
    let _ = decode_finished(data);
});
