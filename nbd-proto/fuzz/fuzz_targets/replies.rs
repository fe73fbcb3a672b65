#![no_main]
//! A READ or BLOCK_STATUS request and a hostile server's reply stream, through the client's
//! reply checks (`nbd_proto::fuzzing::replies`): no panic, nothing written outside the
//! request's buffer, no byte written twice.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    nbd_proto::fuzzing::replies(data);
});
