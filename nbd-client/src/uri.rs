//! NBD URIs: `nbd://host[:port][/export]` (IPv6 literals in brackets, default port 10809)
//! and `nbd+unix:///export?socket=PATH` (a local Unix-domain socket, which the soft NIC
//! carries as a reliable QP).
//!
//! A small hand-written parser for the subset of the NBD URI specification that a QP can
//! carry, with TLS (`nbds://`, `nbds+unix://`) and libnbd's TLS query parameters
//! (`tls-certificates`, `tls-psk-file`, `tls-username`, `tls-verify-peer`).

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
    /// `nbds://`: TLS is required, with these parameters.
    pub tls: Option<TlsParams>,
}

/// The TLS parameters of an `nbds://` URI, as libnbd names them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsParams {
    /// `tls-certificates=DIR`: ca-cert.pem, and client-cert.pem/client-key.pem if there.
    pub certificates: Option<PathBuf>,
    /// `tls-psk-file=FILE`: psktool's format.
    pub psk_file: Option<PathBuf>,
    /// `tls-username=NAME` (or `nbds://NAME@host`): the PSK identity.
    pub username: Option<String>,
    /// `tls-verify-peer=false` skips checking the server's certificate (default: checked).
    pub verify_peer: bool,
}

/// Why a string is not a usable NBD URI.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UriError {
    /// Not an `nbd://`, `nbds://`, `nbd+unix://` or `nbds+unix://` URI.
    #[error("{0:?}: not an NBD URI (expected nbd://host[:port][/export])")]
    NotNbd(String),
    /// An NBD URI with something wrong in it.
    #[error("{uri:?}: {why}")]
    Invalid {
        /// The URI.
        uri: String,
        /// What is wrong.
        why: &'static str,
    },
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

/// `tls-verify-peer`'s values, as libnbd takes them.
fn parse_bool(v: &str) -> Option<bool> {
    match v.to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Some(true),
        "false" | "0" | "no" | "off" => Some(false),
        _ => None,
    }
}

fn decode_path(v: &str, uri: &str) -> Result<PathBuf, UriError> {
    let bytes = percent_decode_bytes(v, uri)?;
    let os: std::ffi::OsString = std::os::unix::ffi::OsStringExt::from_vec(bytes);
    Ok(PathBuf::from(os))
}

impl NbdUri {
    /// Parses `nbd[s]://[user@]host[:port][/export][?query]` or
    /// `nbd[s]+unix:///export?socket=PATH[&query]`; the query takes libnbd's TLS
    /// parameters with `nbds`.
    pub fn parse(uri: &str) -> Result<NbdUri, UriError> {
        let Some((scheme, rest)) = uri.split_once("://") else {
            return Err(UriError::NotNbd(uri.to_owned()));
        };
        let (tls, unix) = match scheme.to_ascii_lowercase().as_str() {
            "nbd" => (false, false),
            "nbd+unix" => (false, true),
            "nbds" => (true, false),
            "nbds+unix" => (true, true),
            _ => return Err(UriError::NotNbd(uri.to_owned())),
        };
        if rest.contains('#') {
            return Err(invalid(uri, "a fragment is not supported"));
        }
        let (before, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, path) = match before.find('/') {
            Some(i) => (&before[..i], &before[i + 1..]),
            None => (before, ""),
        };
        let (user, authority) = match authority.rsplit_once('@') {
            Some(_) if !tls => {
                return Err(invalid(uri, "user information is for TLS (nbds://) only"));
            }
            Some((u, a)) => (Some(percent_decode(u, uri)?), a),
            None => (None, authority),
        };
        let mut socket = None;
        let mut params = TlsParams {
            certificates: None,
            psk_file: None,
            username: user,
            verify_peer: true,
        };
        for param in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = param.split_once('=').unwrap_or((param, ""));
            match k {
                "socket" if unix && !v.is_empty() => socket = Some(decode_path(v, uri)?),
                "socket" if unix => return Err(invalid(uri, "missing socket=PATH")),
                "tls-certificates" if tls => params.certificates = Some(decode_path(v, uri)?),
                "tls-psk-file" if tls => params.psk_file = Some(decode_path(v, uri)?),
                "tls-username" if tls => params.username = Some(percent_decode(v, uri)?),
                "tls-verify-peer" if tls => {
                    params.verify_peer = parse_bool(v)
                        .ok_or_else(|| invalid(uri, "tls-verify-peer takes true or false"))?;
                }
                _ if k.starts_with("tls-") && !tls => {
                    return Err(invalid(uri, "TLS parameters need nbds:// or nbds+unix://"));
                }
                _ if unix => {
                    return Err(invalid(
                        uri,
                        "unsupported query parameter (socket=PATH and, with nbds, tls-certificates, tls-psk-file, tls-username, tls-verify-peer)",
                    ));
                }
                _ => {
                    return Err(invalid(
                        uri,
                        "unsupported query parameter (with nbds: tls-certificates, tls-psk-file, tls-username, tls-verify-peer)",
                    ));
                }
            }
        }
        if params.certificates.is_some() && params.psk_file.is_some() {
            return Err(invalid(
                uri,
                "tls-certificates and tls-psk-file do not go together",
            ));
        }
        let tls = tls.then_some(params);
        let export = percent_decode(path, uri)?;
        if unix {
            if !authority.is_empty() {
                return Err(invalid(
                    uri,
                    "a Unix-socket URI takes no host: nbd+unix:///export?socket=PATH",
                ));
            }
            let socket = socket.ok_or_else(|| invalid(uri, "missing socket=PATH"))?;
            return Ok(NbdUri {
                host: String::new(),
                port: 0,
                export,
                socket: Some(socket),
                tls,
            });
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
            export,
            socket: None,
            tls,
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
        use std::os::unix::ffi::OsStrExt;
        let s = if self.tls.is_some() { "s" } else { "" };
        // The query: the socket, then the TLS parameters that differ from the defaults.
        let mut query: Vec<(&str, &[u8])> = Vec::new();
        if let Some(socket) = &self.socket {
            query.push(("socket", socket.as_os_str().as_bytes()));
        }
        if let Some(t) = &self.tls {
            if let Some(d) = &t.certificates {
                query.push(("tls-certificates", d.as_os_str().as_bytes()));
            }
            if let Some(p) = &t.psk_file {
                query.push(("tls-psk-file", p.as_os_str().as_bytes()));
            }
            if let Some(u) = &t.username {
                query.push(("tls-username", u.as_bytes()));
            }
            if !t.verify_peer {
                query.push(("tls-verify-peer", b"false"));
            }
        }
        if self.socket.is_some() {
            write!(f, "nbd{s}+unix:///")?;
        } else if self.host.contains(':') {
            write!(f, "nbd{s}://[{}]:{}/", self.host, self.port)?;
        } else {
            write!(f, "nbd{s}://{}:{}/", self.host, self.port)?;
        }
        percent_encode(f, self.export.as_bytes())?;
        for (i, (k, v)) in query.iter().enumerate() {
            write!(f, "{}{k}=", if i == 0 { '?' } else { '&' })?;
            percent_encode(f, v)?;
        }
        Ok(())
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
                tls: None,
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
        assert!(matches!(
            NbdUri::parse("http://h/e"),
            Err(UriError::NotNbd(_))
        ));
        assert!(matches!(NbdUri::parse("/tmp/x"), Err(UriError::NotNbd(_))));
        assert!(NbdUri::parse("nbd://:10809/e").is_err());
        assert!(NbdUri::parse("nbd://h:99999/e").is_err());
        assert!(NbdUri::parse("nbd://h:0/e").is_err());
        assert!(NbdUri::parse("nbd://h/e?x=1").is_err());
        assert!(NbdUri::parse("nbd://h/e#f").is_err());
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
            (
                "nbd+unix:///disk?socket=/s&tls=on",
                "unsupported query parameter",
            ),
            (
                "nbd+unix:///disk?socket=/s&tls-certificates=/d",
                "need nbds",
            ),
            ("nbd+unix:///disk?socket=/s#f", "fragment"),
            ("nbd+unix:///disk?socket=%zz", "percent"),
        ] {
            let e = NbdUri::parse(bad).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn tls_uris_take_libnbd_parameters() {
        let u = p("nbds://alice@h:1/e?tls-psk-file=/k%20s.psk");
        let t = u.tls.clone().unwrap();
        assert_eq!(t.username.as_deref(), Some("alice"));
        assert_eq!(
            t.psk_file.as_deref(),
            Some(std::path::Path::new("/k s.psk"))
        );
        assert!(t.verify_peer && t.certificates.is_none());
        assert_eq!(
            u.to_string(),
            "nbds://h:1/e?tls-psk-file=/k%20s.psk&tls-username=alice"
        );
        assert_eq!(p(&u.to_string()), u);
        let u = p("NBDS+UNIX:///e?socket=/s&tls-certificates=/c&tls-verify-peer=false");
        let t = u.tls.clone().unwrap();
        assert_eq!(t.certificates.as_deref(), Some(std::path::Path::new("/c")));
        assert!(!t.verify_peer);
        assert_eq!(p(&u.to_string()), u);
        assert!(p("nbds://h/e").tls.unwrap().verify_peer);
        assert!(p("nbd://h/e").tls.is_none());
        for (bad, why) in [
            ("nbd://h/e?tls-certificates=/c", "need nbds"),
            ("nbd://u@h/e", "TLS (nbds://) only"),
            ("nbds://h/e?tls-verify-peer=maybe", "true or false"),
            (
                "nbds://h/e?tls-certificates=/c&tls-psk-file=/k",
                "do not go together",
            ),
            ("nbds://h/e?x=1", "unsupported query parameter"),
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
