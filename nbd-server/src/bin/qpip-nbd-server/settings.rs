//! What the server is to do: the configuration file and the flags merged, and checked before
//! anything is started or opened.

use std::net::{Ipv6Addr, SocketAddr};

use anyhow::{Context, Result, bail};
use qpip_core::DEFAULT_LANAI_SERVER_NODE;

use crate::args::{Cli, EncryptionArg};
use crate::config::{self, Config, ExportConfig, parse_listen};
use crate::metrics::MetricsAddr;

/// The configuration with the flags applied.
pub(crate) struct Settings {
    /// The file's settings, the flags' exports, addresses and default export added.
    pub cfg: Config,
    /// No export was given: the demo image is served as export "demo".
    pub demo: bool,
    /// The addresses to listen on, resolved (empty with only --socket, or when activated).
    pub listen: Vec<SocketAddr>,
    /// With --backend lanai: this node's fabric address.
    pub lanai_addr: Option<Ipv6Addr>,
    /// Where to serve live statistics (--metrics, or the file's `metrics`).
    pub metrics: Option<MetricsAddr>,
}

impl Settings {
    pub(crate) fn merge(cli: &Cli) -> Result<Settings> {
        let mut cfg = match &cli.config {
            Some(path) => Config::load(path)?,
            None => Config::default(),
        };
        cfg.listen.extend(cli.listen.iter().cloned());
        let demo = add_exports(cli, &mut cfg)?;
        let lanai_addr = cli.nic.lanai_addr(DEFAULT_LANAI_SERVER_NODE)?;
        add_addresses(cli, &mut cfg, lanai_addr)?;
        if let Some(d) = cli.default_export.clone() {
            cfg.default_export = Some(d);
        }
        if let Some(d) = &cfg.default_export
            && !cfg.exports.iter().any(|e| &e.name == d)
        {
            bail!("default export {d:?} is not one of the exports");
        }
        // Addresses are checked before any image is opened or created.
        let mut listen = Vec::new();
        for s in &cfg.listen {
            for a in parse_listen(s)? {
                if !listen.contains(&a) {
                    listen.push(a);
                }
            }
        }
        if let Some(node) = lanai_addr
            && let Some(v4) = listen.iter().find(|a| a.is_ipv4())
        {
            bail!(
                "cannot listen on {v4}: the lanai NIC speaks IPv6 only (this node is {node}; try --listen [{node}]:10809)"
            );
        }
        let metrics = (cli.metrics.as_deref().or(cfg.metrics.as_deref()))
            .map(MetricsAddr::parse)
            .transpose()?;
        Ok(Settings {
            cfg,
            demo,
            listen,
            lanai_addr,
            metrics,
        })
    }
}

fn split_pair<'a>(s: &'a str, what: &str) -> Result<(&'a str, &'a str)> {
    s.split_once('=')
        .with_context(|| format!("{what} {s:?} is not NAME=VALUE"))
}

fn flag_export(name: &str, path: &str) -> ExportConfig {
    ExportConfig {
        name: name.into(),
        path: path.into(),
        description: String::new(),
        read_only: false,
        snapshot: false,
        allocation_depth: false,
        bitmap: Vec::new(),
        create_size: None,
        format: None,
        encryption_format: None,
        encryption_passphrase_file: None,
        allow_backing_dir: Vec::new(),
        load_snapshot: None,
    }
}

/// Adds --export, qemu-nbd's positional FILE (with -x) and the descriptions to the file's
/// exports, or the demo export when there are none (true).
fn add_exports(cli: &Cli, cfg: &mut Config) -> Result<bool> {
    for e in &cli.export {
        let (name, path) = split_pair(e, "--export")?;
        cfg.exports.push(flag_export(name, path));
    }
    // qemu-nbd's form: one image, named by -x (default: the empty name, as qemu-nbd's).
    let positional = match cli.image.as_slice() {
        [] => {
            if let Some(n) = &cli.export_name {
                bail!(
                    "-x/--export-name {n:?} names the image given as FILE, and there is none (give one, or use --export {n}=PATH)"
                );
            }
            None
        }
        [image] => {
            let name = cli.export_name.clone().unwrap_or_default();
            let path = image
                .to_str()
                .with_context(|| format!("image path {} is not UTF-8", image.display()))?;
            cfg.exports.push(flag_export(&name, path));
            cfg.default_export.get_or_insert_with(|| name.clone());
            Some(name)
        }
        [..] => bail!(
            "{} image files given: like qemu-nbd, the server takes one FILE; serve more with --export NAME=PATH each",
            cli.image.len()
        ),
    };
    // -D TEXT and qemu-nbd's --description TEXT (no "="): the FILE's export, or the only one.
    let single = |what: &str| -> Result<String> {
        if let Some(name) = &positional {
            return Ok(name.clone());
        }
        match cfg.exports.as_slice() {
            [one] => Ok(one.name.clone()),
            [] => bail!("{what}: there is no export to describe"),
            all => bail!(
                "{what}: {} exports, which one? Give --description NAME=TEXT",
                all.len()
            ),
        }
    };
    let mut described = Vec::new();
    if let Some(text) = &cli.describe {
        described.push((single("-D")?, text.clone()));
    }
    for d in &cli.description {
        match d.split_once('=') {
            Some((name, text)) => described.push((name.to_string(), text.to_string())),
            None => described.push((single("--description TEXT")?, d.clone())),
        }
    }
    for (name, text) in described {
        let e = cfg
            .exports
            .iter_mut()
            .find(|e| e.name == name)
            .with_context(|| {
                format!("--description: no export named {name:?} (for a text with \"=\" in it, use -D TEXT)")
            })?;
        e.description = text;
    }
    for f in &cli.encryption_format {
        let (name, value) = match f.split_once('=') {
            Some((name, v)) => (Some(name), v),
            None => (None, f.as_str()),
        };
        let format = <EncryptionArg as clap::ValueEnum>::from_str(value, true).map_err(|_| {
            anyhow::anyhow!("--encryption-format {f:?}: the format is luks1 or luks2")
        })?;
        for e in encryption_targets(cfg, name, "--encryption-format", true)? {
            e.encryption_format = Some(format);
        }
    }
    for f in &cli.encryption_passphrase_file {
        // NAME=FILE where NAME is an export; else the whole value is the file.
        let (name, file) = match f.split_once('=') {
            Some((name, file)) if cfg.exports.iter().any(|e| e.name == name) => (Some(name), file),
            _ => (None, f.as_str()),
        };
        // FILE alone: every rbd: export and every image file (those not encrypted
        // ignore it).
        for e in encryption_targets(cfg, name, "--encryption-passphrase-file", false)? {
            e.encryption_passphrase_file = Some(file.into());
        }
    }
    let demo = cfg.exports.is_empty();
    if demo {
        cfg.exports.push(ExportConfig {
            name: "demo".into(),
            path: "(memory)".into(),
            description: "generated 64 MiB demo image, in memory".into(),
            read_only: false,
            snapshot: false,
            allocation_depth: false,
            bitmap: Vec::new(),
            create_size: None,
            format: None,
            encryption_format: None,
            encryption_passphrase_file: None,
            allow_backing_dir: Vec::new(),
            load_snapshot: None,
        });
        cfg.default_export.get_or_insert_with(|| "demo".into());
    }
    Ok(demo)
}

/// The exports an --encryption-* option is for: export `name`, or every export (every
/// rbd: export with `rbd_only`).
fn encryption_targets<'a>(
    cfg: &'a mut Config,
    name: Option<&str>,
    what: &str,
    rbd_only: bool,
) -> Result<Vec<&'a mut ExportConfig>> {
    let is_rbd = |e: &ExportConfig| e.path.to_str().is_some_and(|p| p.starts_with("rbd:"));
    let all: Vec<&mut ExportConfig> = match name {
        Some(n) => cfg.exports.iter_mut().filter(|e| e.name == n).collect(),
        None => cfg
            .exports
            .iter_mut()
            .filter(|e| !rbd_only || is_rbd(e))
            .collect(),
    };
    if all.is_empty() {
        match name {
            Some(n) => bail!("{what}: no export named {n:?}"),
            None if rbd_only => bail!("{what}: no rbd: export to apply it to"),
            None => bail!("{what}: no export to apply it to"),
        }
    }
    Ok(all)
}

/// Adds --bind (at --port) to the listen addresses, or the defaults when none is given.
fn add_addresses(cli: &Cli, cfg: &mut Config, lanai_addr: Option<Ipv6Addr>) -> Result<()> {
    let port = cli.port.unwrap_or(config::DEFAULT_PORT);
    if cli.port.is_some() && !cli.listen.is_empty() {
        bail!("--port goes with --bind or the default addresses; --listen names its own port");
    }
    for b in &cli.bind {
        let host = if b.contains(':') && !b.starts_with('[') {
            format!("[{b}]") // a bare IPv6 address
        } else {
            b.clone()
        };
        cfg.listen.push(format!("{host}:{port}"));
    }
    // A Unix socket alone: no TCP address unless one is asked for.
    let tcp = !cfg.listen.is_empty() || cli.port.is_some() || cli.socket.is_none();
    if cfg.listen.is_empty() && tcp && cli.run.is_some() && cli.port.is_none() {
        cfg.listen = vec!["127.0.0.1:0".into()]; // captive: a free port, no clash
    }
    if cfg.listen.is_empty() && tcp {
        cfg.listen = match lanai_addr {
            Some(a) => vec![format!("[{a}]:{port}")],
            None => vec![port.to_string()],
        };
    }
    Ok(())
}
