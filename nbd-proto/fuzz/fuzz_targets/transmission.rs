#![no_main]
//! Arbitrary bytes into `nbd_proto::fuzzing::transmission`: no panic, bounded output.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    nbd_proto::fuzzing::transmission(data);
});
