//! qpip-nbd-mount URI MOUNTPOINT (or nbdfuse's MOUNTPOINT[/FILENAME] URI): an NBD export as
//! one regular file in a FUSE mount.

// The doc comments of the options are clap's --help text, where brackets are literal
// ("[::1]", "nbd://HOST[:PORT]/EXPORT"), not links.
#![allow(rustdoc::broken_intra_doc_links)]

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use fuse_mount::export::Export;
use fuse_mount::fs::NbdFs;
use fuse_mount::session::{Cache, Config, Session, Transport};
use fuse_mount::{file_name, mount, mountpoint};
use nbd_client::client::STOP_GRACE;
use nbd_client::{Client, ClientOptions, Error as NbdError, NbdUri, Nic, Pool};
use qpip_cli::NicArgs;
use qpip_cli::refused::Refused;

#[derive(Parser, Debug)]
#[command(
    name = "qpip-nbd-mount",
    version,
    about = "Mount an NBD export (over Queue Pair IP) as one regular file in a FUSE directory",
    long_about = "Mount an NBD export (over Queue Pair IP) as one regular file in a FUSE directory.\n\n\
        The export appears inside MOUNTPOINT as a file named after the export (\"nbd\" for the \
        empty export name) with the export's size. read and write go to the server, fsync is \
        NBD FLUSH, fallocate PUNCH_HOLE is NBD TRIM (the range then reads as zeroes) and \
        ZERO_RANGE is WRITE_ZEROES. truncate cannot change the file's size (O_TRUNC is ignored, \
        as for a block device, so dd and cp write over it), but the size follows the \
        export's: when a reconnect finds the export resized, or (for exports that offer NBD's \
        RESIZE, such as qpip-nbd-server's rbd: exports) the server says so when asked every \
        2 s, stat shows the new size and the page cache past a shrunk end is dropped (with \
        the writeback cache, files opened before keep their size). A read-only export (or \
        --read-only) gives a read-only mount and a 0444 file. The file can be used with \
        losetup, mkfs and mount like a disk.\n\n\
        Runs in the foreground until the file system is unmounted (fusermount3 -u MOUNTPOINT, \
        umount, or SIGINT/SIGTERM, which unmount it; a mount still in use, e.g. by a loop \
        device, stays mounted and is reported). A lost connection is restored and unanswered \
        requests are sent again; I/O that cannot complete fails with EIO.\n\n\
        nbdfuse's spellings work too: its argument order MOUNTPOINT[/FILENAME] URI (the file \
        is then FILENAME, or \"nbd\" as in nbdfuse; the order is told apart by which argument \
        is the URI), -o FUSE-OPTION (allow_other, ro, rw), -P/--pidfile, -r/--readonly. \
        nbdfuse's [ CMD ARGS ... ], --command, --fd, --tcp, --unix and --vsock modes are not \
        supported: start the server and give its URI.",
    after_help = "Examples:\n  \
        qpip-nbd-mount nbd://127.0.0.1/disk /mnt/nbd &\n  \
        qpip-nbd-mount --daemon /mnt/nbd/disk.raw nbd://127.0.0.1/disk   # nbdfuse's order\n  \
        losetup -f --show /mnt/nbd/disk\n  \
        qpip-nbd-mount --daemon --read-only nbd://[::1]:10809/golden /mnt/golden\n  \
        qpip-nbd-mount --daemon --log-file /var/log/qpip-mount.log nbd://h/disk /mnt/nbd\n  \
        fusermount3 -u /mnt/nbd"
)]
struct Cli {
    /// The URI (then MOUNTPOINT follows), or, in nbdfuse's order, MOUNTPOINT[/FILENAME]
    /// (then the URI follows). The URI: nbd://HOST[:PORT][/EXPORT],
    /// nbd+unix:///EXPORT?socket=PATH for a local socket, or nbds:// / nbds+unix:// for TLS
    /// (libnbd's tls-certificates, tls-psk-file, tls-username, tls-verify-peer query
    /// parameters). MOUNTPOINT: an existing directory with nothing mounted on it.
    #[arg(value_name = "URI | MOUNTPOINT[/FILENAME]")]
    first: String,
    /// MOUNTPOINT after a URI, or the URI after nbdfuse's MOUNTPOINT[/FILENAME].
    #[arg(value_name = "MOUNTPOINT | URI")]
    second: String,
    /// Mount read-only even when the export is writable (--readonly: nbdfuse's spelling).
    #[arg(short = 'r', long, visible_alias = "readonly")]
    read_only: bool,
    /// FUSE options as nbdfuse takes them, comma-separated or repeated: allow_other (as
    /// --allow-other), ro (as --read-only), rw. Others are refused.
    #[arg(short = 'o', value_name = "FUSE-OPTION")]
    fuse_options: Vec<String>,
    /// Let other users use the mount (FUSE allow_other; off by default, as in nbdfuse; the
    /// file's mode bits are then enforced by the kernel).
    #[arg(long)]
    allow_other: bool,
    /// Connections to the server when it allows multi-conn (one otherwise).
    #[arg(short = 'C', long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    connections: u16,
    /// FUSE request threads [default: connections + 2, at least 6]: /dev/fuse readers, or
    /// on io_uring the ring entries (each with its thread) per queue (one queue per CPU).
    /// Their requests pipeline on the connections, so they bound the queue depth the
    /// server sees.
    #[arg(short = 'T', long, value_parser = clap::value_parser!(u16).range(1..=256))]
    threads: Option<u16>,
    /// One FUSE request thread (--threads 1), as nbdfuse's -s.
    #[arg(short = 's', conflicts_with = "threads")]
    single_thread: bool,
    /// How the kernel hands FUSE requests over: io_uring (Linux 6.14+ with
    /// /sys/module/fuse/parameters/enable_uring on), /dev/fuse, or auto (io_uring when the
    /// kernel offers it, else /dev/fuse, saying why).
    #[arg(long, value_enum, default_value_t = Transport::Auto)]
    fuse_transport: Transport,
    /// The mount's read-ahead window in KiB (/sys/class/bdi/MAJ:MIN/read_ahead_kb; the
    /// kernel's default is 128). 0 leaves the kernel's value.
    #[arg(long, default_value_t = 4096, value_name = "KIB")]
    read_ahead_kb: u32,
    /// What the kernel caches of the file (`none` for large sequential copies onto it; for a
    /// file system on a loop device, keep the default and attach it with
    /// `losetup --direct-io=on`).
    #[arg(long, value_enum, default_value_t = Cache::Writeback)]
    cache: Cache,
    /// How long to keep reconnecting after the server was lost (reset, closed, silent) before
    /// unanswered requests fail with EIO; the clock runs from the server's last answer, so
    /// a server that accepts connections and drops them cannot keep it going. A server that
    /// breaks the protocol is not reconnected to: its requests fail with EIO at once.
    #[arg(long, default_value_t = 30.0, value_name = "SECS")]
    reconnect_timeout: f64,
    /// With requests in flight and no reply for this long, the server counts as lost (as
    /// above); 0 waits forever.
    #[arg(long, default_value_t = 60.0, value_name = "SECS")]
    request_timeout: f64,
    /// Detach into the background once mounted (errors before that still exit non-zero).
    #[arg(long)]
    daemon: bool,
    /// Once mounted, the log (standard error) goes to FILE, appended; created 0640 if
    /// missing, never through a symlink. With --daemon it is otherwise thrown away.
    #[arg(long, value_name = "FILE")]
    log_file: Option<PathBuf>,
    /// Write the process id to this file once mounted (-P, --pidfile: nbdfuse's spellings).
    #[arg(short = 'P', long, visible_alias = "pidfile", value_name = "FILE")]
    pid_file: Option<PathBuf>,
    // Logging: -v/-q from the default, warn.
    #[command(flatten)]
    log: qpip_cli::logging::LogArgs,
    #[command(flatten)]
    nic: NicArgs,
}

/// The two orders of the positional arguments.
const ORDERS: &str = "give URI MOUNTPOINT (qpip-nbd-mount's order) or MOUNTPOINT[/FILENAME] URI \
                      (nbdfuse's)";

/// What the positional arguments name, in either order.
#[derive(Debug, PartialEq, Eq)]
struct Target {
    uri: String,
    mountpoint: PathBuf,
    /// The file's name inside the mount point; `None`: named after the export.
    file: Option<String>,
    /// nbdfuse's order.
    nbdfuse: bool,
}

/// Tells the orders apart by which argument is the URI; a usage error otherwise.
fn target(first: &str, second: &str) -> Result<Target, String> {
    use nbd_client::uri::looks_like_uri;
    match (looks_like_uri(first), looks_like_uri(second)) {
        (true, false) => Ok(Target {
            uri: first.into(),
            mountpoint: second.into(),
            file: None,
            nbdfuse: false,
        }),
        (false, true) => {
            // nbdfuse: an existing directory is the mount point (file "nbd"); otherwise the
            // last component names the file in the directory above.
            let p = Path::new(first);
            let split = (!p.is_dir())
                .then(|| Some((p.parent()?, p.file_name()?.to_str()?)))
                .flatten()
                .filter(|(d, _)| !d.as_os_str().is_empty());
            let (mountpoint, file) = match split {
                Some((d, f)) => (d.to_path_buf(), f.to_string()),
                None => (p.to_path_buf(), "nbd".to_string()),
            };
            Ok(Target {
                uri: second.into(),
                mountpoint,
                file: Some(file),
                nbdfuse: true,
            })
        }
        (true, true) => Err(format!(
            "{ORDERS}: both {first:?} and {second:?} look like NBD URIs"
        )),
        (false, false) => Err(format!(
            "{ORDERS}: neither {first:?} nor {second:?} is an NBD URI (nbd://, nbd+unix://, \
             nbds://, nbds+unix://)"
        )),
    }
}

/// nbdfuse's options that the mount does not take, refused by name.
const REFUSED: &[Refused] = &[
    Refused {
        names: &[
            "--command",
            "--fd",
            "--tcp",
            "--unix",
            "--vsock",
            "--socket-activation",
        ],
        tool: "nbdfuse",
        why: "the server is given as an NBD URI here (nbd://HOST:PORT/EXPORT, \
              nbd+unix:///EXPORT?socket=PATH): start it yourself and give its URI",
    },
    Refused {
        names: &["--fuse-help"],
        tool: "nbdfuse",
        why: "the FUSE options taken are -o allow_other, ro and rw",
    },
    Refused {
        names: &["-d"],
        tool: "nbdfuse",
        why: "libnbd and FUSE debugging: the mount's own log is -v -v (or --log debug)",
    },
];

/// A usage error: one line, exit status 2 (as clap's).
fn usage_error(msg: &str) -> ! {
    eprintln!("qpip-nbd-mount: {msg}");
    std::process::exit(2)
}

fn main() {
    qpip_cli::man::generate_if_asked(<Cli as clap::CommandFactory>::command);
    if std::env::args().skip(1).any(|a| a == "[") {
        usage_error(&format!(
            "nbdfuse's [ CMD ARGS ... ] (a server run as a subprocess) is not supported: start \
             the server yourself and {ORDERS}"
        ));
    }
    let mut cli: Cli = qpip_cli::refused::parse(REFUSED);
    for o in cli.fuse_options.iter().flat_map(|o| o.split(',')) {
        match o {
            "allow_other" => cli.allow_other = true,
            "ro" => cli.read_only = true,
            "rw" | "" => {}
            other => usage_error(&format!(
                "-o {other}: a FUSE option qpip-nbd-mount does not take (it takes allow_other, \
                 ro, rw; see --help for its own options)"
            )),
        }
    }
    cli.log.init(
        "qpip-nbd-mount",
        tracing_subscriber::filter::LevelFilter::WARN,
    );
    let code = match run(cli) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("qpip-nbd-mount: error: {}", message(&e));
            1
        }
    };
    std::process::exit(code);
}

/// The error and its causes on one line, leaving out causes the message before already says.
fn message(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if !out.contains(&c) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&c);
        }
    }
    out
}

/// How the process tells a waiting parent (--daemon) that the mount is up or failed.
struct Ready {
    pipe: Option<File>,
    /// --log-file, opened: standard error goes there once mounted.
    log: Option<File>,
}

impl Ready {
    fn ok(&mut self) {
        if let Some(mut p) = self.pipe.take() {
            let _ = p.write_all(b"0");
            detach_stdio();
        }
        if let Some(log) = self.log.take() {
            use std::os::fd::AsRawFd;
            // SAFETY: plain fd syscalls on fds this process owns.
            unsafe {
                libc::dup2(log.as_raw_fd(), 2);
            }
        }
    }
    /// In the background child: hands the error to the waiting parent, which prints it.
    fn fail(&mut self, e: &anyhow::Error) {
        if let Some(mut p) = self.pipe.take() {
            let _ = write!(p, "1{}", message(e));
            std::process::exit(1);
        }
    }
}

fn detach_stdio() {
    // SAFETY: plain fd syscalls on fds this process owns.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            for fd in 0..3 {
                libc::dup2(null, fd);
            }
            if null > 2 {
                libc::close(null);
            }
        }
    }
}

/// Forks before any thread exists (the soft NIC starts one). The parent waits for the child's
/// verdict and exits with it; the child returns a [`Ready`] to report through.
fn daemonize() -> Result<Ready> {
    let mut fds = [0; 2];
    // SAFETY: fds is a valid array of two ints.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        bail!("pipe: {}", std::io::Error::last_os_error());
    }
    // SAFETY: the fds were just created and are owned here only.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: no other thread exists yet, so the child may run arbitrary code.
    match unsafe { libc::fork() } {
        -1 => bail!("fork: {}", std::io::Error::last_os_error()),
        0 => {
            drop(r);
            // SAFETY: plain syscall.
            unsafe { libc::setsid() };
            Ok(Ready {
                pipe: Some(File::from(w)),
                log: None,
            })
        }
        _child => {
            drop(w);
            let mut msg = String::new();
            let _ = File::from(r).read_to_string(&mut msg);
            match msg.split_at_checked(1) {
                Some(("0", _)) => std::process::exit(0),
                Some(("1", why)) => {
                    eprintln!("qpip-nbd-mount: error: {why}");
                    std::process::exit(1)
                }
                _ => {
                    eprintln!("qpip-nbd-mount: error: the background process exited early");
                    std::process::exit(1)
                }
            }
        }
    }
}

/// Opens --log-file for appending: created 0640, never through a symlink (we may be root).
fn open_log(path: &Path) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o640)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .with_context(|| format!("--log-file {}", path.display()))
}

fn run(cli: Cli) -> Result<()> {
    let target = target(&cli.first, &cli.second).unwrap_or_else(|e| usage_error(&e));
    if target.nbdfuse {
        tracing::info!("arguments in nbdfuse's order: MOUNTPOINT[/FILENAME] URI");
    }
    let uri = NbdUri::parse(&target.uri)?;
    let mnt = mountpoint::check(&target.mountpoint)?;
    let log = cli.log_file.as_deref().map(open_log).transpose()?;
    let mut ready = if cli.daemon {
        daemonize()?
    } else {
        Ready {
            pipe: None,
            log: None,
        }
    };
    ready.log = log;
    match serve(&cli, &target, &uri, &mnt, &mut ready) {
        Ok(()) => Ok(()),
        Err(e) => {
            ready.fail(&e);
            Err(e)
        }
    }
}

/// Connects: the server unreachable, the export unknown (naming the ones there are) and
/// the like are errors here, before anything is mounted.
fn connect(
    cli: &Cli,
    target: &Target,
    uri: &NbdUri,
    nic: &Nic,
    stop: &Arc<AtomicBool>,
) -> Result<Pool> {
    let secs = |what: &str, s: f64| -> Result<Duration> {
        Duration::try_from_secs_f64(s)
            .map_err(|_| anyhow::anyhow!("--{what} {s}: give a number of seconds, 0 or more"))
    };
    let request_timeout = secs("request-timeout", cli.request_timeout)?;
    let opts = ClientOptions {
        nic: Some(nic.clone()),
        reconnect_timeout: secs("reconnect-timeout", cli.reconnect_timeout)?,
        request_timeout: (!request_timeout.is_zero()).then_some(request_timeout),
        stop: Some(stop.clone()),
        ..Default::default()
    };
    let mut pool = match Pool::connect(&target.uri, opts.clone()) {
        Ok(p) => p,
        Err(e) => return Err(explain_connect_error(uri, e, &opts)),
    };
    let want = usize::from(cli.connections);
    if want > 1 && !pool.caps().multi_conn {
        tracing::info!(
            "{uri}: the server does not allow multi-conn; using one connection instead of {want}"
        );
    } else {
        while pool.connections() < want {
            let n = pool.connections() + 1;
            pool.add_connection()
                .with_context(|| format!("opening connection {n} to {uri}"))?;
        }
    }
    if cli.read_only {
        pool.force_read_only();
    }
    Ok(pool)
}

fn explain_connect_error(uri: &NbdUri, e: NbdError, opts: &ClientOptions) -> anyhow::Error {
    if let Some(line) = Client::explain_unknown_export(&uri.to_string(), &e, opts) {
        return anyhow::anyhow!(line);
    }
    match e {
        // Already names the URI and the address.
        NbdError::Connect { .. } => anyhow::Error::new(e),
        e => anyhow::Error::new(e).context(format!("connecting to {uri}")),
    }
}

fn serve(cli: &Cli, target: &Target, uri: &NbdUri, mnt: &Path, ready: &mut Ready) -> Result<()> {
    let nic = Nic::open(cli.nic.choice(None)?)
        .with_context(|| format!("starting the {} NIC", cli.nic.kind.name()))?;
    let stop = Arc::new(AtomicBool::new(false));
    let export = Arc::new(Export::new(connect(cli, target, uri, &nic, &stop)?));
    let caps = *export.caps();
    let name = target
        .file
        .clone()
        .unwrap_or_else(|| file_name(&uri.export));
    let threads = match (cli.single_thread, cli.threads) {
        (true, _) => 1,
        (false, Some(n)) => usize::from(n),
        // Threads pipeline their requests on shared connections: a server without
        // multi-conn (one connection) still gets several requests at once.
        (false, None) => export.connections().max(4) + 2,
    };

    let cache = cli.cache;
    let fs = Arc::new(NbdFs::new(export.clone(), &name, cache == Cache::None));
    let dev = mount::mount(
        mnt,
        &mount::Options {
            fsname: uri.to_string(),
            subtype: "qpip-nbd".into(),
            read_only: caps.read_only,
            allow_other: cli.allow_other,
        },
    )
    .with_context(|| format!("mounting on {}", mnt.display()))?;
    let config = Config {
        transport: cli.fuse_transport,
        threads,
        ring_depth: threads,
        cache,
        read_only: caps.read_only,
    };
    let session = match Session::init(dev, fs, nic.clone(), config) {
        Ok(s) => s,
        Err(e) => {
            let _ = mountpoint::unmount(mnt);
            return Err(
                anyhow::Error::new(e).context(format!("starting FUSE on {}", mnt.display()))
            );
        }
    };
    if let Some(why) = &session.started.fallback {
        tracing::warn!("FUSE over /dev/fuse instead of io_uring: {why}");
    }
    match mount::device_of(mnt) {
        Some(d) => {
            if cli.read_ahead_kb > 0
                && let Err(e) = mount::set_read_ahead(d, cli.read_ahead_kb)
            {
                // SAFETY: plain getter.
                if unsafe { libc::geteuid() } == 0 {
                    tracing::warn!("setting the read-ahead window: {e}");
                } else {
                    tracing::info!("the read-ahead window stays the kernel's ({e}; needs root)");
                }
            }
        }
        None => tracing::warn!("{}: no device number in mountinfo", mnt.display()),
    }
    let started = &session.started;
    tracing::info!(
        %uri,
        file = %mnt.join(&name).display(),
        size = caps.size,
        connections = export.connections(),
        threads,
        read_only = caps.read_only,
        transport = if started.uring { "io_uring" } else { "/dev/fuse" },
        cache = ?cache,
        writeback_cache = started.agreed.writeback_cache(),
        "mounted"
    );
    if let Some(p) = &cli.pid_file {
        // Never through a symlink planted at the path or beside it (we may be root).
        qpip_cli::files::write_pid_file(p)
            .with_context(|| format!("--pid-file {}", p.display()))?;
    }
    watch_signals(mnt.to_path_buf(), stop)?;
    ready.ok();

    let result = session.run();
    if let Some(p) = &cli.pid_file {
        let _ = std::fs::remove_file(p);
    }
    match Arc::try_unwrap(export) {
        Ok(b) => b.close(),
        Err(_) => tracing::warn!("connections still in use at exit"),
    }
    result.with_context(|| format!("serving {}", mnt.display()))?;
    tracing::info!(mountpoint = %mnt.display(), "unmounted");
    Ok(())
}

/// SIGINT, SIGTERM and SIGHUP unmount; the session loop then ends and the process exits 0.
/// A read or write waiting on a server that does not answer would keep the file open (and the
/// unmount busy) for up to the request and reconnect timeouts: the signal first tells the
/// clients to stop waiting (requests in flight without a reply for `STOP_GRACE` fail with
/// EIO), and the unmount is retried while they end.
fn watch_signals(mnt: PathBuf, stop: Arc<AtomicBool>) -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals =
        signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]).context("signals")?;
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            for sig in signals.forever() {
                tracing::info!(sig, "unmounting {}", mnt.display());
                stop.store(true, Ordering::Relaxed);
                let until = Instant::now() + STOP_GRACE + Duration::from_secs(3);
                let result = loop {
                    match mountpoint::unmount(&mnt) {
                        Err(e)
                            if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < until =>
                        {
                            std::thread::sleep(Duration::from_millis(100));
                        }
                        other => break other,
                    }
                };
                match result {
                    Ok(()) => {}
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                        // It goes on serving, with the usual patience for the server.
                        stop.store(false, Ordering::Relaxed);
                        eprintln!(
                            "qpip-nbd-mount: {} is busy (still open, e.g. by a loop device); \
                             it stays mounted: free it and signal again, or fusermount3 -u it",
                            mnt.display()
                        )
                    }
                    Err(e) => eprintln!("qpip-nbd-mount: unmounting {}: {e}", mnt.display()),
                }
            }
        })
        .context("starting the signal thread")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_argument_orders_and_mix_ups() {
        let t = target("nbd://h/disk", "/mnt").unwrap();
        assert_eq!(
            (t.uri.as_str(), t.file, t.nbdfuse),
            ("nbd://h/disk", None, false)
        );
        // An existing directory: the mount point, file "nbd".
        let t = target("/tmp", "nbd://h/disk").unwrap();
        assert_eq!(t.mountpoint, Path::new("/tmp"));
        assert_eq!((t.file.as_deref(), t.nbdfuse), (Some("nbd"), true));
        let t = target("/tmp/disk.raw", "nbd+unix:///d?socket=/s").unwrap();
        assert_eq!(t.mountpoint, Path::new("/tmp"));
        assert_eq!(t.file.as_deref(), Some("disk.raw"));
        assert!(
            target("/a", "/b")
                .unwrap_err()
                .contains("MOUNTPOINT[/FILENAME] URI")
        );
        assert!(target("nbd://a", "nbd://b").unwrap_err().contains("both"));
    }
}
