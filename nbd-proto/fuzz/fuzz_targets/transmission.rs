#![no_main]
//! Arbitrary bytes into `nbd_proto::fuzzing::transmission`: the server's request parser and
//! its replies, and the reply parsers; no panic, and the invariants asserted there hold.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    nbd_proto::fuzzing::transmission(data);
});
