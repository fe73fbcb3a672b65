//! qpip-nbd-server: exports disk images over Queue Pair IP. The wire is plain NBD (fixed
//! newstyle), so qemu-img, qemu-io, nbdinfo, nbdcopy, fio and the Linux kernel client talk to
//! it unchanged.
//!
//! Over 600 lines: the command line: its options with their help text are most of it.

mod config;
mod daemon;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use config::{Config, ExportConfig, parse_listen, parse_size};
use nbd_proto::handshake::TlsMode;
use nbd_server::backend::Backend;
use nbd_server::export::Export;
use nbd_server::image::{Format, Image};
use nbd_server::server::{Server, ServerOptions};
use qpip_cli::BackendArgs;
use qpip_cli::logging::LogArgs;
use qpip_core::lanai::realtime::DEFAULT_SERVER_NODE;
use qpip_core::{Endpoint, Nic, TlsConfig, TlsCredentials};

#[derive(Parser, Debug)]
#[command(
    name = "qpip-nbd-server",
    version,
    about = "Export disk images over NBD, carried by Queue Pair IP",
    long_about = "Export disk images over NBD, carried by Queue Pair IP.\n\n\
        Every connection runs on a QP of the soft NIC (or, with --backend lanai, of the QPIP \
        firmware on an emulated LANai 9 NIC; see docs/lanai.md): requests land in registered receive \
        buffers and read replies of raw images are sent straight from the image's registered \
        mapping (a qcow2 image is served as its virtual disk, through its cluster tables). The \
        wire is plain NBD (fixed newstyle), so any NBD client works.\n\n\
        With no arguments it creates a 64 MiB demo image in memory (gone when the server \
        exits) and serves it as export \"demo\" (also the default export) on [::1]:10809 and 127.0.0.1:10809.",
    after_help = "Socket activation: started by systemd with LISTEN_PID and LISTEN_FDS set, the \
        server serves on the sockets passed to it (from fd 3) instead of listening itself.\n\n\
        Examples:\n  \
        qpip-nbd-server --export disk=/var/lib/images/disk.img\n  \
        qpip-nbd-server --listen 0.0.0.0:10809 --export scratch=/tmp/s.img --create 4G\n  \
        qpip-nbd-server --config configs/server.toml\n  \
        qpip-nbd-server --fork --pid-file /run/qpip.pid -f qcow2 --export vm=vm.qcow2\n  \
        qpip-nbd-server --export d=disk.img --run 'qemu-img info \"$uri\"'\n  \
        qemu-img info nbd://127.0.0.1/disk"
)]
struct Cli {
    /// Address to listen on: ADDR:PORT (IPv6 in brackets), HOST:PORT, HOST (port 10809) or a
    /// bare PORT (the default addresses); repeat for several. Default: [::1]:10809 and
    /// 127.0.0.1:10809; with --backend lanai, the node's fabric address,
    /// [fd00:4c41:4e41::1]:10809 for node "server".
    #[arg(short, long, value_name = "ADDR:PORT")]
    listen: Vec<String>,
    /// The port, as qemu-nbd and nbdkit spell it: for every --bind address, or for the
    /// default addresses.
    #[arg(short, long, value_name = "PORT")]
    port: Option<u16>,
    /// An address or host name to listen on at --port (default 10809), as qemu-nbd and
    /// nbdkit spell it; repeat for several.
    #[arg(short, long, value_name = "ADDR")]
    bind: Vec<String>,
    /// Listen on a Unix-domain socket at PATH (qemu-nbd's -k, nbdkit's --unix), created
    /// readable and writable by the server's user only and removed when the server exits; a
    /// stale socket left there by a dead server is replaced. Clients connect with
    /// nbd+unix:///EXPORT?socket=PATH. Alone, the server listens on no TCP address; add
    /// --listen/--port/--bind for both. The soft NIC only (the LANai reaches its fabric only).
    /// (-U is --force-share, as in qemu-img and qemu-io.)
    #[arg(short = 'k', long, visible_alias = "unix", value_name = "PATH")]
    socket: Option<PathBuf>,
    /// An export: NAME=PATH of an image file or block device, or NAME=rbd:POOL/IMAGE[@SNAP]
    /// of a Ceph RBD image (see --ceph-conf; a snapshot is served read-only); repeat for
    /// several.
    #[arg(short, long, value_name = "NAME=PATH")]
    export: Vec<String>,
    /// A TOML configuration file (see configs/server.toml); flags add to it.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The images' format: raw (the file's bytes are the disk) or qcow2 (its virtual disk).
    /// Default: probed from each image's first bytes, as qemu-nbd does; an image in another
    /// format (vmdk, vdi, qcow version 1, luks, ...) is left out with an error line while
    /// the other exports are served (with none left, the server fails). A guest of an image
    /// probed as raw cannot give it another format: a write that would put another format's
    /// header in its first 512 bytes fails with EPERM. `-f raw` serves any file's bytes as
    /// they are, without that check.
    #[arg(short, long, value_name = "FORMAT", value_enum)]
    format: Option<Format>,
    /// Export every image read-only.
    #[arg(short, long)]
    read_only: bool,
    /// Take no image locks (qemu's -U): serve an image that qemu or another server has open.
    /// Without it, a writable export is refused while anyone else uses the image, and a
    /// read-only one while anyone writes it, as qemu-nbd does.
    #[arg(short = 'U', long)]
    force_share: bool,
    /// The Ceph configuration for rbd: exports (default: librados' search: $CEPH_CONF,
    /// /etc/ceph/ceph.conf, ~/.ceph/config, ./ceph.conf), as qemu's conf=.
    #[arg(long, value_name = "FILE")]
    ceph_conf: Option<PathBuf>,
    /// The Ceph client id for rbd: exports, without "client." (default admin), as qemu's id=.
    #[arg(long, value_name = "ID")]
    ceph_id: Option<String>,
    /// The keyring holding the client's key (default: the one the configuration names), as
    /// qemu's keyring=.
    #[arg(long, value_name = "FILE")]
    ceph_keyring: Option<PathBuf>,
    /// Seconds that connecting to the Ceph cluster, and then each RBD request, may take
    /// before it fails (the client then gets EIO; other exports keep serving).
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    ceph_timeout: u64,
    /// Create missing images, sparse, with this size (e.g. 1G, 512M).
    #[arg(long, value_name = "SIZE")]
    create: Option<String>,
    /// A description for an export, shown by `nbdinfo --list`: NAME=TEXT.
    #[arg(long, value_name = "NAME=TEXT")]
    description: Vec<String>,
    /// The export a client gets when it asks for the empty name.
    #[arg(long, value_name = "NAME")]
    default_export: Option<String>,
    /// Serve at most this many clients at once (default 64); only clients past the NBD
    /// handshake count, and one more is refused (its connection closed) with a log line.
    #[arg(long, value_name = "N")]
    max_connections: Option<usize>,
    /// Connections still in their handshake at once (default 256); a new one beyond this
    /// drops the oldest, so idle or slow sockets cannot lock clients out. A handshake that
    /// takes longer than 10 s is dropped in any case.
    #[arg(long, value_name = "N")]
    max_handshakes: Option<usize>,
    /// Close a client's connection after SECS without a request while nothing is in flight
    /// (default: never), or after SECS (at most 60) in which the client read none of the
    /// replies sent to it (without this option: 60 s). The client sees its server go away, as
    /// after a restart.
    #[arg(long, value_name = "SECS")]
    idle_timeout: Option<u64>,
    /// Memory for receive buffers shared by busy connections (default 256M). Each connection
    /// has 4 MiB of its own; one whose client pipelines deeper takes more from this pool, up
    /// to 32 MiB, and TCP flow control holds clients once it is spent.
    #[arg(long, value_name = "SIZE")]
    buffer_memory: Option<String>,
    /// Do not answer NBD_OPT_LIST with the export names.
    #[arg(long)]
    no_list: bool,
    /// Run in the background once serving: the command returns (status 0) when the
    /// listeners are bound and the images open, or fails with the server's error. The
    /// server's stdout goes to /dev/null then, and so does its stderr (the log) if it is a
    /// pipe; redirect it to a file to keep the log: `--fork 2>>server.log`.
    #[arg(long)]
    fork: bool,
    /// Write the server's process id to FILE once it is serving (removed at a clean exit).
    #[arg(long, value_name = "FILE")]
    pid_file: Option<PathBuf>,
    /// Captive mode, as nbdkit's: once serving, run CMD with `sh -c`, where $uri (and $nbd)
    /// is the default export's nbd://HOST:PORT/EXPORT and $port the port (with only
    /// --socket: nbd+unix:///EXPORT?socket=PATH and $unixsocket); the server shuts
    /// down when CMD exits and exits with CMD's status. With --run and no address given, it
    /// listens on 127.0.0.1 at a free port.
    #[arg(long, value_name = "CMD")]
    run: Option<String>,
    /// TLS, as nbdkit's --tls: off; on (offered: a client may upgrade with STARTTLS or stay
    /// in plaintext); require (every option before STARTTLS is refused with
    /// NBD_REP_ERR_TLS_REQD). Default: require when --tls-certs or --tls-psk is given, else
    /// off. The soft NIC's engine does the TLS record layer; the LANai backend has no TLS.
    #[arg(long, value_enum, value_name = "MODE")]
    tls: Option<TlsArg>,
    /// X.509 credentials: a directory holding ca-cert.pem, server-cert.pem and
    /// server-key.pem (the layout of qemu's tls-creds-x509 and nbdkit's --tls-certificates).
    #[arg(long, value_name = "DIR")]
    tls_certs: Option<PathBuf>,
    /// With --tls-certs: accept only clients presenting a certificate signed by its
    /// ca-cert.pem.
    #[arg(long, requires = "tls_certs")]
    tls_verify_peer: bool,
    /// Pre-shared keys instead of certificates: a file in psktool's format (IDENTITY:HEXKEY
    /// per line); a client with any of them may connect.
    #[arg(long, value_name = "FILE", conflicts_with = "tls_certs")]
    tls_psk: Option<PathBuf>,
    /// Shut down (as on SIGTERM) when the process that started the server exits.
    #[arg(long)]
    exit_with_parent: bool,
    // Logging: -v/-q from the default, info.
    #[command(flatten)]
    log: LogArgs,
    #[command(flatten)]
    backend: BackendArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum TlsArg {
    Off,
    On,
    Require,
}

/// The TLS mode and the NIC's credentials, checked (files loaded) before anything starts.
fn tls_setup(cli: &Cli) -> Result<(TlsMode, Option<TlsConfig>)> {
    let credentials = match (&cli.tls_certs, &cli.tls_psk) {
        (Some(dir), _) => {
            let ca = dir.join("ca-cert.pem");
            Some((
                format!("--tls-certs {}", dir.display()),
                TlsCredentials::X509 {
                    // Only a verifying server needs the CA.
                    ca: (cli.tls_verify_peer || ca.exists()).then_some(ca),
                    cert: Some(dir.join("server-cert.pem")),
                    key: Some(dir.join("server-key.pem")),
                    verify_peer: cli.tls_verify_peer,
                },
            ))
        }
        (None, Some(file)) => Some((
            format!("--tls-psk {}", file.display()),
            TlsCredentials::Psk {
                keys: qpip_core::tls::read_psk_file(file, None).context("--tls-psk")?,
            },
        )),
        (None, None) => None,
    };
    let mode = match (cli.tls, &credentials) {
        (Some(TlsArg::Off), None) | (None, None) => TlsMode::Off,
        (Some(TlsArg::Off), Some((what, _))) => bail!("--tls off does not go with {what}"),
        (Some(_), None) => {
            bail!("--tls on and --tls require need --tls-certs DIR or --tls-psk FILE")
        }
        (Some(TlsArg::On), Some(_)) => TlsMode::On,
        (Some(TlsArg::Require) | None, Some(_)) => TlsMode::Require,
    };
    let Some((what, credentials)) = credentials else {
        return Ok((mode, None));
    };
    let config = TlsConfig {
        server: true,
        credentials,
        server_name: None,
    };
    qpip_core::soft::check_tls(&config).with_context(|| what.clone())?;
    Ok((mode, Some(config)))
}

fn split_pair<'a>(s: &'a str, what: &str) -> Result<(&'a str, &'a str)> {
    s.split_once('=')
        .with_context(|| format!("{what} {s:?} is not NAME=VALUE"))
}

/// The demo export: a generated image in anonymous memory (a memfd). Not a file under
/// $TMPDIR: a predictable path there lets any local user plant a symlink to a file of
/// root's, which the server would then export read-write.
fn demo_image() -> Result<Image> {
    let img = Image::anonymous("qpip-demo.img", DEMO_SIZE).context("creating the demo image")?;
    let banner = b"qpip demo image: served by qpip-nbd-server over Queue Pair IP\n";
    img.write_at(banner, 0, false)
        .context("writing the demo image")?;
    Ok(img)
}

const DEMO_SIZE: u64 = 64 << 20;

/// The Ceph cluster connection that rbd: exports share, made by the first one.
#[derive(Default)]
struct Ceph {
    #[cfg(feature = "rbd")]
    cluster: Option<Arc<nbd_server::rbd::Cluster>>,
}

impl Ceph {
    /// Opens `rbd:SPEC`.
    #[cfg(feature = "rbd")]
    fn open(&mut self, cli: &Cli, spec: &str, read_only: bool) -> Result<Box<dyn Backend>> {
        use nbd_server::rbd::{Cluster, ClusterOptions, RbdImage, RbdSpec};
        let spec = RbdSpec::parse(spec).map_err(anyhow::Error::msg)?;
        let cluster = match &self.cluster {
            Some(c) => c.clone(),
            None => {
                let c = Cluster::connect(&ClusterOptions {
                    conf: cli.ceph_conf.clone(),
                    id: cli.ceph_id.clone(),
                    keyring: cli.ceph_keyring.clone(),
                    timeout: Duration::from_secs(cli.ceph_timeout),
                })
                .map_err(anyhow::Error::msg)?;
                self.cluster = Some(c.clone());
                c
            }
        };
        Ok(Box::new(
            RbdImage::open(cluster, &spec, read_only).map_err(anyhow::Error::msg)?,
        ))
    }

    #[cfg(not(feature = "rbd"))]
    fn open(&mut self, _cli: &Cli, spec: &str, _read_only: bool) -> Result<Box<dyn Backend>> {
        bail!(
            "rbd:{spec}: this qpip-nbd-server was built without RBD support (build it with --features nbd-server/rbd, which needs librbd-dev)"
        )
    }
}

fn main() {
    qpip_cli::man::generate_if_asked(<Cli as clap::CommandFactory>::command);
    let cli = Cli::parse();
    cli.log.init(
        "qpip-nbd-server",
        tracing_subscriber::filter::LevelFilter::INFO,
    );
    match run(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("qpip-nbd-server: {e:#}");
            std::process::exit(1);
        }
    }
}

/// Runs the server; the exit status (that of the --run command, or 0).
fn run(cli: Cli) -> Result<i32> {
    if cli.fork && (cli.exit_with_parent || cli.run.is_some()) {
        bail!(
            "--fork goes with neither --run nor --exit-with-parent, which need the server to stay the caller's child"
        );
    }
    // Before any thread is started (the NIC is opened below).
    let activated = daemon::socket_activation()?;
    if activated.is_some()
        && (!cli.listen.is_empty()
            || cli.port.is_some()
            || !cli.bind.is_empty()
            || cli.socket.is_some())
    {
        bail!(
            "socket activation (LISTEN_FDS) passes the sockets: --listen, --port, --bind and --socket do not go with it"
        );
    }
    let mut cfg = match &cli.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    cfg.listen.extend(cli.listen.iter().cloned());
    for e in &cli.export {
        let (name, path) = split_pair(e, "--export")?;
        cfg.exports.push(ExportConfig {
            name: name.into(),
            path: path.into(),
            description: String::new(),
            read_only: false,
            create_size: None,
            format: None,
        });
    }
    for d in &cli.description {
        let (name, text) = split_pair(d, "--description")?;
        let e = cfg
            .exports
            .iter_mut()
            .find(|e| e.name == name)
            .with_context(|| format!("--description: no export named {name:?}"))?;
        e.description = text.into();
    }
    let demo = cfg.exports.is_empty();
    if demo {
        cfg.exports.push(ExportConfig {
            name: "demo".into(),
            path: "(memory)".into(),
            description: "generated 64 MiB demo image, in memory".into(),
            read_only: false,
            create_size: None,
            format: None,
        });
        cfg.default_export.get_or_insert_with(|| "demo".into());
    }
    let lanai_addr = cli.backend.lanai_addr(DEFAULT_SERVER_NODE)?;
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
    let (tls_mode, tls_config) = tls_setup(&cli)?;
    if tls_config.is_some() && cli.backend.backend.name() == "lanai" {
        bail!("--tls: the lanai backend has no TLS (the soft NIC's engine does it)");
    }
    let mut readiness = if cli.fork {
        Some(daemon::fork()?)
    } else {
        None
    };
    if cli.exit_with_parent {
        daemon::exit_with_parent()?;
    }
    let backend = cli.backend.backend(Some(DEFAULT_SERVER_NODE))?;
    let nic = Nic::open(backend)
        .with_context(|| format!("starting the {} NIC", cli.backend.backend.name()))?;
    // Bound before any image is opened or created: an address in use fails first.
    let listen = match activated {
        Some(fds) => fds
            .into_iter()
            .map(|fd| nic.listen_fd(fd))
            .collect::<Result<Vec<_>, _>>()
            .context("socket activation")?,
        None => {
            let mut l = listen
                .iter()
                .map(|a| nic.listen(*a)) // the error names the address
                .collect::<Result<Vec<_>, _>>()?;
            if let Some(path) = &cli.socket {
                l.push(nic.listen_unix(path)?); // the error names the path
            }
            l
        }
    };
    let mut exports = Vec::new();
    // Exports whose file is in a format the server does not serve, with why.
    let mut left_out = Vec::new();
    let mut ceph = Ceph::default();
    for e in &cfg.exports {
        if exports.iter().any(|x: &Arc<Export>| x.name == e.name) {
            bail!("export {:?} is given twice", e.name);
        }
        let create = cli.create.as_deref().or(e.create_size.as_deref());
        let read_only = cli.read_only || e.read_only;
        let format = cli.format.or(e.format);
        if let Some(spec) = e.path.to_str().and_then(|p| p.strip_prefix("rbd:"))
            && !demo
        {
            if create.is_some() {
                bail!(
                    "export {}: --create makes image files; make an RBD image with rbd create",
                    e.name
                );
            }
            if format == Some(Format::Qcow2) {
                bail!(
                    "export {}: an RBD image is served as raw (its bytes are the disk)",
                    e.name
                );
            }
            let store = ceph
                .open(&cli, spec, read_only)
                .with_context(|| format!("export {}", e.name))?;
            tracing::info!(export = %e.name, "{} ({}, {} bytes{})", store.location(), store.kind(), store.size(), if store.read_only() { ", read-only" } else { "" });
            exports.push(Export::with_backend(
                &nic,
                e.name.clone(),
                e.description.clone(),
                store,
            ));
            continue;
        }
        let image = match create {
            _ if demo => Ok(demo_image()?),
            Some(_) if !e.path.exists() && format == Some(Format::Qcow2) => bail!(
                "export {}: {} does not exist, and --create makes raw images only (make a qcow2 one with qemu-img create -f qcow2)",
                e.name,
                e.path.display()
            ),
            Some(size) if !e.path.exists() => {
                let size = parse_size(size)?;
                if size == 0 {
                    bail!(
                        "export {}: --create 0: an export needs at least one byte",
                        e.name
                    );
                }
                Image::create(&e.path, size).with_context(|| {
                    format!(
                        "export {}: creating {} ({size} bytes)",
                        e.name,
                        e.path.display()
                    )
                })?;
                Image::open(&e.path, read_only)
            }
            _ => Image::open_as(&e.path, read_only, format),
        };
        let image = match image {
            Ok(image) => image,
            Err(err) => {
                // A file in a format we do not serve (probed, or qcow2 features) takes down
                // its own export only: a guest must not be able to stop the server.
                let unserved = err.kind() == std::io::ErrorKind::Unsupported;
                // A read-only file or file system: say how to serve it anyway.
                let hint = match err.raw_os_error() {
                    Some(libc::EROFS | libc::EACCES | libc::EPERM) if !read_only => {
                        " (to export it read-only, add --read-only)"
                    }
                    _ => "",
                };
                let err = anyhow::Error::new(err).context(format!(
                    "export {}: opening {}{hint}",
                    e.name,
                    e.path.display()
                ));
                if unserved {
                    left_out.push(err);
                    continue;
                }
                return Err(err);
            }
        };
        if !demo && !cli.force_share {
            image
                .lock()
                .with_context(|| format!("export {}: {}", e.name, e.path.display()))?;
        }
        if let Some(size) = create
            && !demo
        {
            let size = parse_size(size)?;
            if image.size() != size {
                bail!(
                    "export {}: {} has {} bytes, not the {size} that --create asks for (drop --create to serve it as it is)",
                    e.name,
                    e.path.display(),
                    image.size()
                );
            }
        }
        tracing::info!(export = %e.name, "{} ({}, {} bytes{})", e.path.display(), image.format().name(), image.size(), if read_only { ", read-only" } else { "" });
        exports.push(Export::new(
            &nic,
            e.name.clone(),
            e.description.clone(),
            image,
        ));
    }
    // With no export left the server fails with the last one's error, as with one export.
    if exports.is_empty()
        && let Some(err) = left_out.pop()
    {
        for e in &left_out {
            tracing::error!("{e:#}");
        }
        return Err(err);
    }
    for e in &left_out {
        tracing::error!("{e:#}; serving the other exports without it");
    }
    // --run's URI names the default export, else the first one served.
    let first_export = exports.first().map(|e| e.name.clone()).unwrap_or_default();

    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("installing signal handlers")?;
    }
    let server = Server::start(
        nic,
        exports,
        ServerOptions {
            listen,
            max_connections: cli.max_connections.or(cfg.max_connections).unwrap_or(64),
            max_handshakes: cli.max_handshakes.or(cfg.max_handshakes).unwrap_or(256),
            buffer_memory: match cli
                .buffer_memory
                .as_deref()
                .or(cfg.buffer_memory.as_deref())
            {
                Some(s) => parse_size(s).context("--buffer-memory")?,
                None => 256 << 20,
            },
            idle_timeout: match cli.idle_timeout.or(cfg.idle_timeout) {
                None => None,
                Some(0) => bail!("--idle-timeout 0: give a number of seconds above 0"),
                Some(s) => Some(Duration::from_secs(s)),
            },
            default_export: cfg.default_export.clone(),
            list_exports: cfg.list_exports.unwrap_or(true) && !cli.no_list,
            tls: tls_mode,
            tls_config,
        },
    )?;
    // Status lines go to stderr, like the log: stdout is the user's (`--run 'nbdcopy "$uri" -'
    // > disk.raw` must hold the image's bytes only). -q silences them.
    let status = cli.log.quiet == 0;
    for a in server.local_addrs() {
        if status {
            eprintln!("qpip-nbd-server: listening on {a}");
        }
    }
    if demo && status {
        match lanai_addr {
            Some(a) => eprintln!(
                "qpip-nbd-server: serving the demo image as export \"demo\"; try: qpip-nbd info --backend lanai nbd://[{a}]/demo"
            ),
            None => eprintln!(
                "qpip-nbd-server: serving the demo image as export \"demo\"; try: nbdinfo nbd://127.0.0.1/demo"
            ),
        }
    }
    let _pid_file = match &cli.pid_file {
        Some(p) => Some(daemon::PidFile::write(p)?),
        None => None,
    };
    let mut captive = match &cli.run {
        Some(cmd) => {
            let addrs = server.local_addrs();
            let ip = addrs.iter().filter_map(|e| match e {
                Endpoint::Ip(a) => Some(*a),
                Endpoint::Unix(_) => None,
            });
            let v4 = ip.clone().find(|a| a.is_ipv4());
            let export = cfg.default_export.clone().unwrap_or(first_export);
            let mut sh = std::process::Command::new("sh");
            sh.arg("-c").arg(cmd);
            match v4.or(ip.clone().next()) {
                Some(a) => {
                    let host = match a.ip() {
                        std::net::IpAddr::V4(ip) if ip.is_unspecified() => "127.0.0.1".to_string(),
                        std::net::IpAddr::V4(ip) => ip.to_string(),
                        std::net::IpAddr::V6(ip) if ip.is_unspecified() => "[::1]".to_string(),
                        std::net::IpAddr::V6(ip) => format!("[{ip}]"),
                    };
                    let uri = format!("nbd://{host}:{}/{export}", a.port());
                    sh.env("uri", &uri)
                        .env("nbd", &uri)
                        .env("port", a.port().to_string());
                }
                // Only a Unix socket: nbdkit's $unixsocket, and the URI naming it.
                None => {
                    let path = cli
                        .socket
                        .as_deref()
                        .context("--run: no listening address")?;
                    let uri = format!("nbd+unix:///{export}?socket={}", path.display());
                    sh.env("uri", &uri).env("nbd", &uri).env("unixsocket", path);
                }
            }
            Some(
                sh.spawn()
                    .with_context(|| format!("--run {cmd:?}: starting sh"))?,
            )
        }
        None => None,
    };
    if let Some(r) = readiness.as_mut() {
        r.ready();
    }
    let mut code = 0;
    while !stop.load(Ordering::Relaxed) {
        if let Some(child) = captive.as_mut()
            && let Some(status) = child.try_wait().context("--run: waiting for the command")?
        {
            use std::os::unix::process::ExitStatusExt;
            code = status
                .code()
                .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
            tracing::info!("--run command exited ({status}): shutting down");
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    tracing::info!("shutting down: finishing in-flight requests");
    server.shutdown(Duration::from_secs(10));
    if let Some(mut child) = captive
        && child.try_wait().ok().flatten().is_none()
    {
        // A signal stopped the server first: the command gets SIGTERM too, and its status.
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        if let Ok(status) = child.wait() {
            code = status.code().unwrap_or(1);
        }
    }
    Ok(code)
}
