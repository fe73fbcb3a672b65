//! NBD URIs: `nbd://host[:port][/export]` (IPv6 literals in brackets, default port 10809)
//! and `nbd+unix:///export?socket=PATH` (a local Unix-domain socket, which the soft NIC
//! carries as a reliable QP).
//!
//! A small hand-written parser for the subset of the NBD URI specification that a QP can
//! carry. TLS (`nbds://`, `nbds+unix://`) is not implemented.

use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::str::FromStr;

/// The IANA port of NBD.
pub const DEFAULT_PORT: u16 = 10809;

/// A parsed NBD URI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NbdUri {
    /// Host name or address (an IPv6 literal without its brackets); empty with `socket`.
    pub host: String,
    /// The port; 0 with `socket`.
    pub port: u16,
    /// Export name ("" = the server's default export).
    pub export: String,
    /// The Unix-domain socket of an `nbd+unix://` URI.
    pub socket: Option<PathBuf>,
}

/// Why a string is not a usable NBD URI.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UriError {
    #[error("{0:?}: not an NBD URI (expected nbd://host[:port][/export])")]
    NotNbd(String),
    #[error("{0:?}: TLS (nbds://, nbds+unix://) is not supported")]
    Tls(String),
    #[error("{uri:?}: {why}")]
    Invalid { uri: String, why: &'static str },
}

fn invalid(uri: &str, why: &'static str) -> UriError {
    UriError::Invalid {
        uri: uri.to_owned(),
        why,
    }
}

fn percent_decode(s: &str, uri: &str) -> Result<String, UriError> {
    let bytes = percent_decode_bytes(s, uri)?;
    String::from_utf8(bytes).map_err(|_| invalid(uri, "export name is not UTF-8"))
}

fn percent_decode_bytes(s: &str, uri: &str) -> Result<Vec<u8>, UriError> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = b
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| invalid(uri, "bad percent escape"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Ok(out)
}

/// Percent-encodes `bytes` for a URI, keeping unreserved characters and `/`.
fn percent_encode(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    for &b in bytes {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            write!(f, "{}", b as char)?;
        } else {
            write!(f, "%{b:02X}")?;
        }
    }
    Ok(())
}

impl NbdUri {
    /// Parses `nbd://host[:port][/export]` or `nbd+unix:///export?socket=PATH`.
    pub fn parse(uri: &str) -> Result<NbdUri, UriError> {
        let Some((scheme, rest)) = uri.split_once("://") else {
            return Err(UriError::NotNbd(uri.to_owned()));
        };
        match scheme.to_ascii_lowercase().as_str() {
            "nbd" => {}
            "nbd+unix" => return Self::parse_unix(uri, rest),
            "nbds" | "nbds+unix" => return Err(UriError::Tls(uri.to_owned())),
            _ => return Err(UriError::NotNbd(uri.to_owned())),
        }
        if rest.contains('?') || rest.contains('#') {
            return Err(invalid(uri, "query and fragment are not supported"));
        }
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, ""),
        };
        if authority.contains('@') {
            return Err(invalid(uri, "user information is not supported"));
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let end = v6
                .find(']')
                .ok_or_else(|| invalid(uri, "unterminated IPv6 literal"))?;
            let host = &v6[..end];
            if host.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(invalid(uri, "bad IPv6 literal"));
            }
            let after = &v6[end + 1..];
            let port = match after {
                "" => None,
                p => Some(
                    p.strip_prefix(':')
                        .ok_or_else(|| invalid(uri, "garbage after the IPv6 literal"))?,
                ),
            };
            (host, port)
        } else {
            match authority.rsplit_once(':') {
                Some((h, _)) if h.contains(':') => {
                    return Err(invalid(uri, "IPv6 addresses must be in brackets"));
                }
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err(invalid(uri, "missing host"));
        }
        let port = match port {
            None | Some("") => DEFAULT_PORT,
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| invalid(uri, "bad port"))?,
        };
        Ok(NbdUri {
            host: host.to_owned(),
            port,
            export: percent_decode(path, uri)?,
            socket: None,
        })
    }

    /// `nbd+unix:///export?socket=PATH`: no authority, the socket in the query.
    fn parse_unix(uri: &str, rest: &str) -> Result<NbdUri, UriError> {
        if rest.contains('#') {
            return Err(invalid(uri, "a fragment is not supported"));
        }
        let (before, query) = rest.split_once('?').unwrap_or((rest, ""));
        let path = match before.strip_prefix('/') {
            Some(p) => p,
            None if before.is_empty() => "",
            None => {
                return Err(invalid(
                    uri,
                    "nbd+unix:// takes no host: nbd+unix:///export?socket=PATH",
                ));
            }
        };
        let mut socket = None;
        for param in query.split('&').filter(|p| !p.is_empty()) {
            match param.split_once('=') {
                Some(("socket", v)) if !v.is_empty() => {
                    let bytes = percent_decode_bytes(v, uri)?;
                    let os: std::ffi::OsString = std::os::unix::ffi::OsStringExt::from_vec(bytes);
                    socket = Some(PathBuf::from(os));
                }
                Some(("socket", _)) => return Err(invalid(uri, "missing socket=PATH")),
                _ => {
                    return Err(invalid(
                        uri,
                        "the only query parameter supported is socket=PATH",
                    ));
                }
            }
        }
        let socket = socket.ok_or_else(|| invalid(uri, "missing socket=PATH"))?;
        Ok(NbdUri {
            host: String::new(),
            port: 0,
            export: percent_decode(path, uri)?,
            socket: Some(socket),
        })
    }

    /// Resolves the host to socket addresses (numeric addresses without DNS).
    pub fn socket_addrs(&self) -> std::io::Result<Vec<SocketAddr>> {
        Ok((self.host.as_str(), self.port).to_socket_addrs()?.collect())
    }
}

impl FromStr for NbdUri {
    type Err = UriError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        NbdUri::parse(s)
    }
}

impl fmt::Display for NbdUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(socket) = &self.socket {
            f.write_str("nbd+unix:///")?;
            percent_encode(f, self.export.as_bytes())?;
            f.write_str("?socket=")?;
            return percent_encode(
                f,
                std::os::unix::ffi::OsStrExt::as_bytes(socket.as_os_str()),
            );
        }
        if self.host.contains(':') {
            write!(f, "nbd://[{}]:{}/", self.host, self.port)?;
        } else {
            write!(f, "nbd://{}:{}/", self.host, self.port)?;
        }
        percent_encode(f, self.export.as_bytes())
    }
}

/// True if `s` looks like a URI rather than a local path (used by `qpip-nbd copy`).
pub fn looks_like_uri(s: &str) -> bool {
    s.split_once("://").is_some_and(|(scheme, _)| {
        scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '+')
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> NbdUri {
        NbdUri::parse(s).unwrap()
    }

    #[test]
    fn host_port_export() {
        assert_eq!(
            p("nbd://example.com:1234/disk"),
            NbdUri {
                host: "example.com".into(),
                port: 1234,
                export: "disk".into(),
                socket: None,
            }
        );
        assert_eq!(p("nbd://10.0.0.1").port, DEFAULT_PORT);
        assert_eq!(p("nbd://10.0.0.1").export, "");
        assert_eq!(p("nbd://10.0.0.1/").export, "");
        assert_eq!(p("nbd://10.0.0.1:/x").port, DEFAULT_PORT);
        assert_eq!(p("NBD://h/a/b").export, "a/b");
        assert_eq!(p("nbd://h/my%20disk").export, "my disk");
    }

    #[test]
    fn ipv6_literals() {
        let u = p("nbd://[::1]:10810/e");
        assert_eq!(
            (u.host.as_str(), u.port, u.export.as_str()),
            ("::1", 10810, "e")
        );
        assert_eq!(p("nbd://[fe80::1]").port, DEFAULT_PORT);
        assert_eq!(u.to_string(), "nbd://[::1]:10810/e");
        assert_eq!(p(&u.to_string()), u);
        assert!(NbdUri::parse("nbd://::1/e").is_err());
        assert!(NbdUri::parse("nbd://[::1/e").is_err());
        assert!(NbdUri::parse("nbd://[zz]/e").is_err());
        assert!(NbdUri::parse("nbd://[::1]x/e").is_err());
    }

    #[test]
    fn refusals_are_clear() {
        assert!(matches!(NbdUri::parse("nbds://h/e"), Err(UriError::Tls(_))));
        assert!(matches!(
            NbdUri::parse("nbds+unix:///e?socket=/s"),
            Err(UriError::Tls(_))
        ));
        assert!(matches!(
            NbdUri::parse("http://h/e"),
            Err(UriError::NotNbd(_))
        ));
        assert!(matches!(NbdUri::parse("/tmp/x"), Err(UriError::NotNbd(_))));
        assert!(NbdUri::parse("nbd://:10809/e").is_err());
        assert!(NbdUri::parse("nbd://h:99999/e").is_err());
        assert!(NbdUri::parse("nbd://h:0/e").is_err());
        assert!(NbdUri::parse("nbd://h/e?x=1").is_err());
        assert!(NbdUri::parse("nbd://h/%zz").is_err());
    }

    #[test]
    fn unix_sockets() {
        let u = p("nbd+unix:///disk?socket=/tmp/my%20s.sock");
        assert_eq!(u.export, "disk");
        assert_eq!(
            u.socket.as_deref(),
            Some(std::path::Path::new("/tmp/my s.sock"))
        );
        assert_eq!(u.to_string(), "nbd+unix:///disk?socket=/tmp/my%20s.sock");
        assert_eq!(p(&u.to_string()), u);
        assert_eq!(p("nbd+unix://?socket=s").export, "");
        assert_eq!(p("NBD+UNIX:///a/b?socket=rel.sock").export, "a/b");
        for (bad, why) in [
            ("nbd+unix:///disk", "missing socket"),
            ("nbd+unix:///disk?socket=", "missing socket"),
            ("nbd+unix://host/disk?socket=/s", "no host"),
            ("nbd+unix:///disk?socket=/s&tls=on", "only query parameter"),
            ("nbd+unix:///disk?socket=/s#f", "fragment"),
            ("nbd+unix:///disk?socket=%zz", "percent"),
        ] {
            let e = NbdUri::parse(bad).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn display_escapes_and_roundtrips() {
        let u = p("nbd://h:1/a%20b");
        assert_eq!(u.to_string(), "nbd://h:1/a%20b");
        assert!(looks_like_uri("nbd://h/e"));
        assert!(looks_like_uri("nbd+unix:///e"));
        assert!(!looks_like_uri("/tmp/a.img"));
        assert!(!looks_like_uri("a.img"));
    }
}
