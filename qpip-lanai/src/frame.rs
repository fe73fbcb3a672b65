//! Myrinet frames: a source route (one byte per switch, consumed as the frame crosses it), a
//! packet type, the IPv6 packet and a CRC-32 trailer.
//!
//! ```text
//! | route len (1) | route (len) | type (2) = 0x86dd | IPv6 packet | crc32 (4) |
//! ```

/// The packet type of an IPv6 payload.
pub const TYPE_IPV6: u16 = 0x86dd;

/// Bytes a frame adds around its IPv6 packet with a route of `route_len` bytes.
pub fn overhead(route_len: usize) -> usize {
    1 + route_len + 2 + 4
}

/// Builds a frame carrying `packet` along `route`.
pub fn encode(route: &[u8], packet: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(overhead(route.len()) + packet.len());
    // Routes are a handful of hops; a longer one cannot be built from the route table.
    f.push(route.len() as u8);
    f.extend_from_slice(route);
    f.extend_from_slice(&TYPE_IPV6.to_be_bytes());
    f.extend_from_slice(packet);
    let crc = crc32(&f);
    f.extend_from_slice(&crc.to_be_bytes());
    f
}

/// Why a frame was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Shorter than its route, type and CRC need (or a switch got one with no route left).
    #[error("frame too short")]
    Truncated,
    /// Corrupted on the way: the CRC-32 trailer does not match.
    #[error("CRC mismatch")]
    BadCrc,
    /// A packet type other than IPv6.
    #[error("unknown packet type {0:#06x}")]
    UnknownType(u16),
    /// Route bytes left over: the frame was delivered to a node before its last switch.
    #[error("frame still has {0} route bytes at its destination")]
    NotAtDestination(usize),
}

/// What a switch does with a frame: the output port and the frame with that route byte
/// consumed (the CRC is recomputed, as a Myrinet switch regenerates its trailer).
pub fn switch(frame: &[u8]) -> Result<(u8, Vec<u8>), FrameError> {
    check_crc(frame)?;
    let len = frame[0] as usize;
    if len == 0 || frame.len() < 1 + len + 2 + 4 {
        return Err(FrameError::Truncated);
    }
    let port = frame[1];
    let mut out = Vec::with_capacity(frame.len() - 1);
    out.push((len - 1) as u8);
    out.extend_from_slice(&frame[2..frame.len() - 4]);
    let crc = crc32(&out);
    out.extend_from_slice(&crc.to_be_bytes());
    Ok((port, out))
}

/// The IPv6 packet of a frame that has reached its destination.
pub fn decode(frame: &[u8]) -> Result<&[u8], FrameError> {
    check_crc(frame)?;
    let len = frame[0] as usize;
    if len != 0 {
        return Err(FrameError::NotAtDestination(len));
    }
    let ty = u16::from_be_bytes([frame[1], frame[2]]);
    if ty != TYPE_IPV6 {
        return Err(FrameError::UnknownType(ty));
    }
    Ok(&frame[3..frame.len() - 4])
}

fn check_crc(frame: &[u8]) -> Result<(), FrameError> {
    if frame.len() < 1 + 2 + 4 || frame.len() < 1 + frame[0] as usize + 2 + 4 {
        return Err(FrameError::Truncated);
    }
    let (body, trailer) = frame.split_at(frame.len() - 4);
    if crc32(body).to_be_bytes() != trailer {
        return Err(FrameError::BadCrc);
    }
    Ok(())
}

const fn crc_table() -> [[u32; 256]; 8] {
    let mut t = [[0u32; 256]; 8];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = (c >> 1) ^ (0xedb8_8320 & (c & 1).wrapping_neg());
            k += 1;
        }
        t[0][i] = c;
        i += 1;
    }
    let mut i = 0;
    while i < 256 {
        let mut s = 1;
        while s < 8 {
            t[s][i] = (t[s - 1][i] >> 8) ^ t[0][(t[s - 1][i] & 0xff) as usize];
            s += 1;
        }
        i += 1;
    }
    t
}
static CRC: [[u32; 256]; 8] = crc_table();

/// CRC-32 (IEEE), slice-by-8: in real time every frame is summed three or four times (built,
/// switched, received), and bitwise summing capped the emulated fabric at ~50 MB/s.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let lo = crc ^ u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        let hi = u32::from_le_bytes([c[4], c[5], c[6], c[7]]);
        crc = CRC[7][(lo & 0xff) as usize]
            ^ CRC[6][((lo >> 8) & 0xff) as usize]
            ^ CRC[5][((lo >> 16) & 0xff) as usize]
            ^ CRC[4][(lo >> 24) as usize]
            ^ CRC[3][(hi & 0xff) as usize]
            ^ CRC[2][((hi >> 8) & 0xff) as usize]
            ^ CRC[1][((hi >> 16) & 0xff) as usize]
            ^ CRC[0][(hi >> 24) as usize];
    }
    for &b in chunks.remainder() {
        crc = (crc >> 8) ^ CRC[0][((crc ^ u32::from(b)) & 0xff) as usize];
    }
    !crc
}

/// A one-line summary of an IPv6 packet for trace logs (TCP: ports, seq, ack, flags, length).
pub(crate) fn summary(p: &[u8]) -> String {
    if p.len() < 40 {
        return format!("{} bytes", p.len());
    }
    let tcp = &p[40..];
    if p[6] == 6 && tcp.len() >= 20 {
        let be32 = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        let hl = usize::from(tcp[12] >> 4) * 4;
        let flags: String = [
            (0x02, 'S'),
            (0x10, '.'),
            (0x08, 'P'),
            (0x01, 'F'),
            (0x04, 'R'),
        ]
        .iter()
        .filter(|(b, _)| tcp[13] & b != 0)
        .map(|(_, c)| *c)
        .collect();
        format!(
            "tcp {}>{} [{flags}] seq {} ack {} win {} len {}",
            u16::from_be_bytes([tcp[0], tcp[1]]),
            u16::from_be_bytes([tcp[2], tcp[3]]),
            be32(&tcp[4..]),
            be32(&tcp[8..]),
            u16::from_be_bytes([tcp[14], tcp[15]]),
            tcp.len().saturating_sub(hl)
        )
    } else {
        format!("next header {} len {}", p[6], p.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_crosses_two_switches_and_decodes() {
        let f = encode(&[3, 7], b"ipv6 packet");
        let (p1, f) = switch(&f).unwrap();
        let (p2, f) = switch(&f).unwrap();
        assert_eq!((p1, p2), (3, 7));
        assert_eq!(decode(&f).unwrap(), b"ipv6 packet");
    }

    #[test]
    fn corruption_and_truncation_are_caught() {
        let mut f = encode(&[1], b"data");
        f[4] ^= 1;
        assert_eq!(switch(&f), Err(FrameError::BadCrc));
        assert_eq!(decode(&[0, 0x86]), Err(FrameError::Truncated));
        assert_eq!(decode(&[5, 1, 2]), Err(FrameError::Truncated));
        let f = encode(&[1], b"data");
        assert_eq!(decode(&f), Err(FrameError::NotAtDestination(1)));
        assert_eq!(crc32(b"123456789"), 0xcbf4_3926);
    }

    #[test]
    fn slice_by_8_matches_the_bitwise_crc() {
        fn bitwise(bytes: &[u8]) -> u32 {
            let mut crc = !0u32;
            for &b in bytes {
                crc ^= u32::from(b);
                for _ in 0..8 {
                    crc = (crc >> 1) ^ (0xedb8_8320 & (crc & 1).wrapping_neg());
                }
            }
            !crc
        }
        let data: Vec<u8> = (0..4099u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for len in [0, 1, 7, 8, 9, 63, 64, 65, 1000, 4099] {
            assert_eq!(crc32(&data[..len]), bitwise(&data[..len]), "length {len}");
        }
    }
}
