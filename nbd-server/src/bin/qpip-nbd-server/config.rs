//! Server configuration: a TOML file (examples in configs/) and command-line flags, merged.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Deserialize;

/// The NBD port registered with IANA.
pub(crate) const DEFAULT_PORT: u16 = 10809;

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub(crate) struct ExportConfig {
    pub name: String,
    pub path: PathBuf,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub read_only: bool,
    /// Snapshot mode (--snapshot): the image opened read-only, writes to a temporary overlay.
    #[serde(default)]
    pub snapshot: bool,
    /// Offer the qemu:allocation-depth metadata context (as --allocation-depth).
    #[serde(default)]
    pub allocation_depth: bool,
    /// The qcow2 persistent dirty bitmaps to offer as qemu:dirty-bitmap:NAME (as --bitmap).
    #[serde(default)]
    pub bitmap: Vec<String>,
    /// Create the image, sparse, with this size if it does not exist ("1G", "512M", bytes).
    #[serde(default)]
    pub create_size: Option<String>,
    /// The image's format ("raw" or "qcow2"); probed from its first bytes when absent.
    #[serde(default)]
    pub format: Option<crate::args::FormatArg>,
    /// An rbd: image encrypted by `rbd encryption format`: "luks1" or "luks2".
    #[serde(default)]
    pub encryption_format: Option<crate::args::EncryptionArg>,
    /// The file holding its passphrase (its bytes as they are).
    #[serde(default)]
    pub encryption_passphrase_file: Option<PathBuf>,
    /// Directories where the files its qcow2 image names may lie besides the image's own
    /// (added to --allow-backing-dir).
    #[serde(default)]
    pub allow_backing_dir: Vec<PathBuf>,
    /// Serve this internal snapshot of the qcow2 image, read-only (--load-snapshot).
    #[serde(default)]
    pub load_snapshot: Option<String>,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct Config {
    #[serde(default)]
    pub listen: Vec<String>,
    #[serde(default, rename = "export")]
    pub exports: Vec<ExportConfig>,
    /// The export a client gets when it asks for the empty name.
    #[serde(default)]
    pub default_export: Option<String>,
    #[serde(default)]
    pub max_connections: Option<usize>,
    /// Connections in their handshake at once; beyond it the oldest is dropped.
    #[serde(default)]
    pub max_handshakes: Option<usize>,
    /// Seconds without a request after which a connection with nothing in flight is closed.
    #[serde(default)]
    pub idle_timeout: Option<u64>,
    /// Receive-buffer memory shared by busy connections ("1G").
    #[serde(default)]
    pub buffer_memory: Option<String>,
    /// Advertise the list of exports (NBD_OPT_LIST); on by default.
    #[serde(default)]
    pub list_exports: Option<bool>,
    /// Where to serve live statistics (--metrics): "ADDR:PORT" or "unix:PATH".
    #[serde(default)]
    pub metrics: Option<String>,
}

impl Config {
    pub(crate) fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing config {}", path.display()))
    }
}

/// The addresses served when none is given: loopback only, IPv6 and IPv4.
pub(crate) fn default_listen(port: u16) -> Vec<SocketAddr> {
    vec![
        SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port)),
        SocketAddr::from(([127, 0, 0, 1], port)),
    ]
}

/// Parses a listen address: `ADDR:PORT` (IPv6 in brackets), `ADDR`, `HOST:PORT` or `HOST`
/// (every address the name resolves to), or a bare `PORT` (the default loopback addresses).
/// The port is 10809 where none is given.
pub(crate) fn parse_listen(s: &str) -> Result<Vec<SocketAddr>> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(vec![a]);
    }
    if let Ok(port) = s.parse::<u16>() {
        return Ok(default_listen(port));
    }
    let bare = s.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<std::net::IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, DEFAULT_PORT)]);
    }
    let (host, port) = match s.rsplit_once(':') {
        Some((h, p)) => (
            h,
            p.parse::<u16>()
                .with_context(|| format!("listen address {s:?}: port {p:?} is not a number"))?,
        ),
        None => (s, DEFAULT_PORT),
    };
    if host.is_empty() || host.contains([':', '[', ']']) {
        bail!(
            "listen address {s:?} is not ADDR:PORT, HOST:PORT or PORT (IPv6 in brackets: [::1]:10809)"
        );
    }
    use std::net::ToSocketAddrs;
    let mut addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .with_context(|| format!("listen address {s:?}: cannot resolve {host:?}"))?
        .collect();
    addrs.sort();
    addrs.dedup();
    if addrs.is_empty() {
        bail!("listen address {s:?}: {host:?} resolves to no address");
    }
    Ok(addrs)
}

/// Parses a size: bytes, or a number with K, M, G or T (powers of 1024).
pub(crate) fn parse_size(s: &str) -> Result<u64> {
    qpip_cli::size::parse_size(s).map_err(|e| anyhow::anyhow!(e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_addresses() {
        assert_eq!(parse_size("512").unwrap(), 512);
        assert_eq!(parse_size("1G").unwrap(), 1 << 30);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert!(parse_size("12Q").is_err());
        let one = |s: &str| {
            let v = parse_listen(s).unwrap();
            assert_eq!(v.len(), 1, "{s}: {v:?}");
            v[0].to_string()
        };
        assert_eq!(one("[::1]:10810"), "[::1]:10810");
        assert_eq!(one("127.0.0.1"), "127.0.0.1:10809");
        assert_eq!(one("[::1]"), "[::1]:10809");
        assert_eq!(parse_listen("10910").unwrap(), default_listen(10910));
        let local = parse_listen("localhost:10911").unwrap();
        assert!(
            !local.is_empty()
                && local
                    .iter()
                    .all(|a| a.ip().is_loopback() && a.port() == 10911)
        );
        assert!(
            parse_listen("localhost")
                .unwrap()
                .iter()
                .all(|a| a.port() == DEFAULT_PORT)
        );
        assert!(parse_listen("nowhere:x").is_err());
        // A bare IPv6 address is an address, on the default port.
        assert_eq!(one("::1:80"), "[::1:80]:10809");
    }

    #[test]
    fn example_configs_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs");
        let mut seen = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("server")
            {
                let cfg = Config::load(&path).unwrap();
                assert!(!cfg.exports.is_empty(), "{}", path.display());
                seen += 1;
            }
        }
        assert!(seen > 0);
    }
}
