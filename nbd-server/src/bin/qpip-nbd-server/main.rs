//! qpip-nbd-server: exports disk images over Queue Pair IP. The wire is plain NBD (fixed
//! newstyle), so qemu-img, qemu-io, nbdinfo, nbdcopy, fio and the Linux kernel client talk to
//! it unchanged.
//!
//! The binary's own modules: [`args`] (the command line), [`config`] (the TOML file),
//! [`settings`] (the two merged), [`exports`] (stores opened through the library's
//! `store::open`), [`daemon`] (fork, pid file, socket activation), [`captive`] (`--run`),
//! [`metrics`] (`--metrics`: live statistics over HTTP).

// The doc comments of the options are clap's --help text, where brackets are literal
// ("[::1]", "nbd://HOST[:PORT]/EXPORT"), not links.
#![allow(rustdoc::broken_intra_doc_links)]

mod args;
mod captive;
mod config;
mod daemon;
mod exports;
mod metrics;
mod settings;

use std::os::fd::OwnedFd;
use std::process::Child;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use args::{Cli, TlsArg};
use config::parse_size;
use metrics::MetricsListener;
use nbd_proto::handshake::TlsMode;
use nbd_server::server::{Server, ServerOptions};
use qpip_core::DEFAULT_LANAI_SERVER_NODE;
use qpip_core::{Listener, Nic, TlsConfig, TlsCredentials};
use settings::Settings;

fn main() {
    qpip_cli::man::generate_if_asked(<Cli as clap::CommandFactory>::command);
    let cli: Cli = qpip_cli::refused::parse(args::REFUSED);
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
    check_flags(&cli)?;
    let activated = socket_activation(&cli)?;
    let settings = Settings::merge(&cli)?;
    let tls = tls_setup(&cli)?;
    let mut readiness = daemonize(&cli)?;
    let nic = open_nic(&cli)?;
    // Bound before any image is opened or created: an address in use fails first.
    let listeners = listen(&nic, &cli, &settings, activated)?;
    let metrics = (settings.metrics.as_ref())
        .map(MetricsListener::bind)
        .transpose()?;
    let exports = exports::open_all(&nic, &cli, &settings)?;
    // --run's URI names the default export, else the first one served.
    let first_export = exports.first().map(|e| e.name.clone()).unwrap_or_default();
    let stop = stop_on_signals()?;
    let server = Server::start(
        nic,
        exports,
        server_options(&cli, &settings, listeners, tls)?,
    )?;
    announce(&cli, &settings, &server);
    if let Some(m) = &metrics
        && cli.log.quiet == 0
    {
        eprintln!("qpip-nbd-server: metrics on {}", m.describe());
    }
    let _metrics = metrics.map(|m| m.serve(server.stats())).transpose()?;
    let _pid_file = cli
        .pid_file
        .as_deref()
        .map(daemon::PidFile::write)
        .transpose()?;
    let mut captive = start_captive(&cli, &settings, &server, &first_export)?;
    if let Some(r) = readiness.as_mut() {
        r.ready();
    }
    let code = wait(&stop, captive.as_mut())?;
    tracing::info!("shutting down: finishing in-flight requests");
    server.shutdown(Duration::from_secs(10));
    Ok(captive::finish(captive, code))
}

/// Flags that do not go together.
fn check_flags(cli: &Cli) -> Result<()> {
    exports::view_options(cli)?;
    if cli.fork && (cli.exit_with_parent || cli.run.is_some()) {
        bail!(
            "--fork goes with neither --run nor --exit-with-parent, which need the server to stay the caller's child"
        );
    }
    Ok(())
}

/// The sockets systemd passed (LISTEN_FDS), taken before any thread is started (the NIC is
/// opened later); they replace the addresses, which then must not be given.
fn socket_activation(cli: &Cli) -> Result<Option<Vec<OwnedFd>>> {
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
    Ok(activated)
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
    qpip_core::check_tls(&config).with_context(|| what.clone())?;
    Ok((mode, Some(config)))
}

/// --fork (the caller waits for the returned readiness) and --exit-with-parent.
fn daemonize(cli: &Cli) -> Result<Option<daemon::Readiness>> {
    let readiness = if cli.fork {
        Some(daemon::fork()?)
    } else {
        None
    };
    if cli.exit_with_parent {
        daemon::exit_with_parent()?;
    }
    Ok(readiness)
}

fn open_nic(cli: &Cli) -> Result<Nic> {
    let choice = cli.nic.choice(Some(DEFAULT_LANAI_SERVER_NODE))?;
    Nic::open(choice).with_context(|| format!("starting the {} NIC", cli.nic.kind.name()))
}

/// The listeners: the sockets passed by socket activation, or the addresses and the Unix
/// socket bound now.
fn listen(
    nic: &Nic,
    cli: &Cli,
    settings: &Settings,
    activated: Option<Vec<OwnedFd>>,
) -> Result<Vec<Listener>> {
    if let Some(fds) = activated {
        return fds
            .into_iter()
            .map(|fd| nic.listen_fd(fd))
            .collect::<Result<Vec<_>, _>>()
            .context("socket activation");
    }
    let mut l = settings
        .listen
        .iter()
        .map(|a| nic.listen(*a)) // the error names the address
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(path) = &cli.socket {
        l.push(nic.listen_unix(path)?); // the error names the path
    }
    Ok(l)
}

/// SIGINT and SIGTERM set the returned flag.
fn stop_on_signals() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("installing signal handlers")?;
    }
    Ok(stop)
}

/// `n`, unless it is 0: a limit of no clients would refuse everyone.
fn at_least_one(option: &str, n: usize) -> Result<usize> {
    if n == 0 {
        bail!("{option} 0: give a number above 0 (a server that admits no client serves nobody)");
    }
    Ok(n)
}

/// The server's limits and protocol settings: the flags over the file over the defaults.
fn server_options(
    cli: &Cli,
    settings: &Settings,
    listen: Vec<Listener>,
    (tls, tls_config): (TlsMode, Option<TlsConfig>),
) -> Result<ServerOptions> {
    let cfg = &settings.cfg;
    Ok(ServerOptions {
        listen,
        max_connections: match cli.shared {
            Some(0) => usize::MAX,
            Some(n) => n,
            None => at_least_one(
                "--max-connections",
                cli.max_connections.or(cfg.max_connections).unwrap_or(64),
            )?,
        },
        handshake_limit: match cli.handshake_limit {
            Some(0) => None,
            Some(s) => Some(Duration::from_secs(s)),
            None => Some(Duration::from_secs(10)),
        },
        max_handshakes: at_least_one(
            "--max-handshakes",
            cli.max_handshakes.or(cfg.max_handshakes).unwrap_or(256),
        )?,
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
        tls,
        tls_config,
    })
}

/// Status lines go to stderr, like the log: stdout is the user's (`--run 'nbdcopy "$uri" -'
/// > disk.raw` must hold the image's bytes only). -q silences them.
fn announce(cli: &Cli, settings: &Settings, server: &Server) {
    if cli.log.quiet != 0 {
        return;
    }
    for a in server.local_addrs() {
        eprintln!("qpip-nbd-server: listening on {a}");
    }
    if settings.demo {
        // The hint names an address the server listens on, with its port when it is not
        // NBD's default (a URI without one means 10809).
        let tcp = server.local_addrs().iter().filter_map(|e| match e {
            qpip_core::Endpoint::Ip(a) => Some(*a),
            qpip_core::Endpoint::Unix(_) => None,
        });
        let addr = tcp
            .clone()
            .find(|a| a.is_ipv4())
            .or_else(|| tcp.clone().next());
        let uri = |a: std::net::SocketAddr| match a.port() {
            10809 if a.is_ipv4() => format!("nbd://{}/demo", a.ip()),
            10809 => format!("nbd://[{}]/demo", a.ip()),
            _ => format!("nbd://{a}/demo"),
        };
        let serving = "qpip-nbd-server: serving the demo image as export \"demo\"; try:";
        match (settings.lanai_addr, addr) {
            (Some(_), Some(a)) => eprintln!("{serving} qpip-nbd info --backend lanai {}", uri(a)),
            (None, Some(a)) => eprintln!("{serving} nbdinfo {}", uri(a)),
            (_, None) => {}
        }
    }
}

/// --run: the command, started once the server serves.
fn start_captive(
    cli: &Cli,
    settings: &Settings,
    server: &Server,
    first_export: &str,
) -> Result<Option<Child>> {
    let Some(cmd) = &cli.run else {
        return Ok(None);
    };
    let export = settings
        .cfg
        .default_export
        .as_deref()
        .unwrap_or(first_export);
    let socket = cli.socket.as_deref();
    captive::spawn(cmd, server.local_addrs(), socket, export).map(Some)
}

/// Waits for a signal, or for the --run command to exit (then its exit status).
fn wait(stop: &AtomicBool, mut captive: Option<&mut Child>) -> Result<i32> {
    while !stop.load(Ordering::Relaxed) {
        if let Some(child) = captive.as_mut()
            && let Some(status) = child.try_wait().context("--run: waiting for the command")?
        {
            tracing::info!("--run command exited ({status}): shutting down");
            return Ok(captive::exit_code(status));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(0)
}
