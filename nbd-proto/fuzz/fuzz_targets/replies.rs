#![no_main]
//! A READ or BLOCK_STATUS request and a hostile server's reply stream, through the client's
//! reply checks (`nbd_proto::fuzzing::replies`) and through the client session's reply
//! assembly: no panic, nothing written outside the request's buffer, no byte written twice,
//! the same judgement and the same bytes whether a READ's data go to the session's buffer or
//! to caller memory.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    nbd_proto::fuzzing::replies(data);
});
