#![no_main]
//! Arbitrary bytes into `nbd_proto::fuzzing::client_handshake`: no panic, bounded output.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    nbd_proto::fuzzing::client_handshake(data);
});
