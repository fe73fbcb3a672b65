//! What hand-made fake NBD servers share: an honest handshake over a plain TCP stream, after
//! which each fake misbehaves in its own way.

use std::io::{Read, Write};
use std::net::TcpStream;

use nbd_proto::handshake::{ServerConfig, ServerEvent, ServerHandshake};

/// Runs the server side of the handshake for `config` on `s`; the bytes the client sent
/// past it (its first requests), or None when the client left or broke the handshake.
pub fn handshake(s: &mut TcpStream, config: ServerConfig) -> Option<Vec<u8>> {
    let mut hs = ServerHandshake::new(config);
    let mut out = hs.greeting().to_vec();
    let mut buf = vec![0u8; 64 << 10];
    loop {
        s.write_all(&out).ok()?;
        out.clear();
        let n = match s.read(&mut buf) {
            Ok(0) | Err(_) => return None,
            Ok(n) => n,
        };
        match hs.feed(&buf[..n], &mut out) {
            Ok(ServerEvent::Continue) => {}
            Ok(ServerEvent::Done(_)) => break,
            _ => return None,
        }
    }
    s.write_all(&out).ok()?;
    Some(hs.take_leftover())
}
