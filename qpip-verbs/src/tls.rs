//! TLS as a NIC service: the host describes the credentials, the NIC (the soft NIC's engine)
//! runs the handshake and the record layer, and the QP's messages stay plaintext on the
//! host's side. Plain data here: each backend builds its own TLS library's context from it,
//! or refuses.

use std::io;
use std::path::{Path, PathBuf};

/// The credentials of one side.
#[derive(Clone)]
#[non_exhaustive]
pub enum TlsCredentials {
    /// X.509 certificates, as PEM files.
    X509 {
        /// CA certificate(s) the peer's certificate must chain to (the client's; the server's
        /// when it verifies clients). None: the system's trust store (client only).
        ca: Option<PathBuf>,
        /// Our certificate (chain): required on a server, optional on a client.
        cert: Option<PathBuf>,
        /// Its private key.
        key: Option<PathBuf>,
        /// Verify the peer's certificate: a client checks the server's (and its name);
        /// a server requires a client certificate signed by `ca`.
        verify_peer: bool,
    },
    /// Pre-shared keys: a server accepts any of them (by identity), a client uses its one.
    Psk {
        /// (identity, key) pairs.
        keys: Vec<(String, Vec<u8>)>,
    },
}

/// TLS for a reliable QP ([`crate::QueuePair::start_tls`]).
#[derive(Clone)]
pub struct TlsConfig {
    /// This side runs the TLS server (else the client).
    pub server: bool,
    /// Certificates or pre-shared keys.
    pub credentials: TlsCredentials,
    /// Client: the name the server's certificate must carry (with `verify_peer`); None when
    /// there is none to check (a Unix socket).
    pub server_name: Option<String>,
}

// Keys are secrets: never printed.
impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let creds = match &self.credentials {
            TlsCredentials::X509 {
                ca,
                cert,
                key,
                verify_peer,
            } => format!(
                "X509 {{ ca: {ca:?}, cert: {cert:?}, key: {key:?}, verify_peer: {verify_peer} }}"
            ),
            TlsCredentials::Psk { keys } => {
                let ids: Vec<&str> = keys.iter().map(|(i, _)| i.as_str()).collect();
                format!("Psk {{ identities: {ids:?} }}")
            }
        };
        f.debug_struct("TlsConfig")
            .field("server", &self.server)
            .field("credentials", &format_args!("{creds}"))
            .field("server_name", &self.server_name)
            .finish()
    }
}

/// Reads a PSK file in psktool's format: one `identity:hexkey` per line. With `identity`,
/// only that entry (it must be there). Errors name the file and the line.
pub fn read_psk_file(path: &Path, identity: Option<&str>) -> io::Result<Vec<(String, Vec<u8>)>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    let bad = |n: usize, why: &str| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{} line {n}: {why}", path.display()),
        )
    };
    let mut keys = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (id, hex) = line
            .split_once(':')
            .ok_or_else(|| bad(i + 1, "not IDENTITY:HEXKEY (as psktool writes)"))?;
        if id.is_empty() {
            return Err(bad(i + 1, "empty identity"));
        }
        let key = decode_hex(hex).ok_or_else(|| bad(i + 1, "the key is not hexadecimal"))?;
        if key.is_empty() {
            return Err(bad(i + 1, "empty key"));
        }
        if identity.is_none_or(|want| want == id) {
            keys.push((id.to_owned(), key));
        }
    }
    match identity {
        Some(want) if keys.is_empty() => Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("{}: no key for identity {want:?}", path.display()),
        )),
        _ if keys.is_empty() => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: no keys", path.display()),
        )),
        _ => Ok(keys),
    }
}

fn decode_hex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psk_files() {
        let dir = std::env::temp_dir().join(format!("qpip-psk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("keys.psk");
        std::fs::write(&f, "alice:00ff10\n\n# comment\nbob:abcd\n").unwrap();
        let all = read_psk_file(&f, None).unwrap();
        assert_eq!(
            all,
            vec![
                ("alice".into(), vec![0, 0xff, 0x10]),
                ("bob".into(), vec![0xab, 0xcd])
            ]
        );
        assert_eq!(read_psk_file(&f, Some("bob")).unwrap().len(), 1);
        let e = read_psk_file(&f, Some("carol")).unwrap_err().to_string();
        assert!(e.contains("keys.psk") && e.contains("carol"), "{e}");
        std::fs::write(&f, "alice:00f\n").unwrap();
        let e = read_psk_file(&f, None).unwrap_err().to_string();
        assert!(e.contains("line 1") && e.contains("hexadecimal"), "{e}");
        std::fs::write(&f, "alice\n").unwrap();
        assert!(read_psk_file(&f, None).is_err());
        assert!(read_psk_file(&dir.join("none"), None).is_err());
        let cfg = TlsConfig {
            server: true,
            credentials: TlsCredentials::Psk {
                keys: vec![("alice".into(), vec![1, 2, 3])],
            },
            server_name: None,
        };
        let shown = format!("{cfg:?}");
        assert!(
            shown.contains("alice") && !shown.contains("[1, 2, 3]"),
            "{shown}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
