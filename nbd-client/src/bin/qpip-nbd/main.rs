//! qpip-nbd: inspect NBD exports and copy between local files and NBD exports, over Queue
//! Pair IP.

// The doc comments of the options are clap's --help text, where brackets are literal
// ("[::1]", "nbd://HOST[:PORT]/EXPORT"), not links.
#![allow(rustdoc::broken_intra_doc_links)]

mod copy;
mod info;
mod side;

use nbd_proto::peer_text::printable;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle, TermLike};
use nbd_client::{Client, ClientOptions};
use qpip_cli::{NicArgs, outln};
use qpip_core::Nic;

#[derive(Parser, Debug)]
#[command(
    name = "qpip-nbd",
    version,
    about = "NBD client over Queue Pair IP: inspect exports, list them, copy disk images",
    long_about = "NBD client over Queue Pair IP: inspect exports, list them, copy disk images.\n\n\
        Every connection runs on a reliable QP of the soft NIC (or, with --backend lanai, of \
        the QPIP firmware on an emulated LANai 9 NIC; see docs/lanai.md); the wire is plain NBD (fixed \
        newstyle), so any NBD server works: qpip-nbd-server, qemu-nbd, nbdkit, nbd-server.\n\n\
        Exports are named by NBD URIs: nbd://HOST[:PORT][/EXPORT], IPv6 literals in brackets \
        (nbd://[::1]/disk), port 10809 by default, the empty export name for the server's \
        default; nbd+unix:///EXPORT?socket=PATH for a server's local Unix-domain socket \
        (soft NIC only). nbds:// and nbds+unix:// require TLS (never falling back to \
        plaintext), with libnbd's query parameters: tls-certificates=DIR (ca-cert.pem, and \
        client-cert.pem/client-key.pem if there), tls-psk-file=FILE (psktool format) with \
        tls-username=NAME or nbds://NAME@HOST, tls-verify-peer=false; the soft NIC's engine \
        does the TLS record layer.\n\n\
        A lost connection is restored with exponential backoff and every unanswered request is \
        sent again; a write counts as done only once the server acknowledged it. After \
        --reconnect-timeout the operation fails (EIO).",
    after_help = "Examples:\n  \
        qpip-nbd info nbd://127.0.0.1/disk\n  \
        qpip-nbd info --json nbd://[::1]:10809/disk\n  \
        qpip-nbd list nbd://storage.example\n  \
        qpip-nbd copy disk.img nbd://127.0.0.1/disk --verify\n  \
        qpip-nbd copy nbd://a/disk nbd://b/disk --connections 4"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    // Logging: -v/-q from the default, warn.
    #[command(flatten)]
    log: qpip_cli::logging::LogArgs,
    #[command(flatten)]
    nic: NicArgs,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Show an export's size, flags, block sizes, contexts and content, as nbdinfo does.
    ///
    /// nbdinfo's spellings: --json prints nbdinfo's keys ("protocol", "TLS", "structured",
    /// "exports": [{"export-name", "content", "uri", "contexts", "is_read_only", "can_trim",
    /// ..., "export-size", "export-size-str"}]); -L/--list shows every export of the server;
    /// --size prints the size alone; --map[=CONTEXT] prints the allocation map, --totals its
    /// summary; --can, --is and --has FEATURE (synonyms, as in nbdinfo) answer by the exit
    /// status (0 yes, 2 no, 1 error), --cannot, --isnt and --hasnt the opposite.
    /// --color/--colour and --no-color/--no-colour are accepted: the text has no colour
    /// (what the server sends is escaped instead). -V prints the version, as nbdinfo's.
    #[command(version)]
    Info {
        /// nbd://HOST[:PORT][/EXPORT] or nbd+unix:///EXPORT?socket=PATH
        uri: String,
        /// Print JSON instead of text: nbdinfo's, byte for byte (its keys, order and layout).
        #[arg(long)]
        json: bool,
        /// Print only the size in bytes.
        #[arg(long, conflicts_with_all = ["list", "map", "can", "cannot"])]
        size: bool,
        /// Every export of the server (the URI's export name is ignored).
        #[arg(short = 'L', long, conflicts_with_all = ["map", "can", "cannot"])]
        list: bool,
        /// Probe the content: the first 8 KiB through file(1), as nbdinfo (its default
        /// without --list; omitted where file(1) is not installed).
        #[arg(long, overrides_with = "no_content")]
        content: bool,
        /// Do not read the export's content (the default with --list).
        #[arg(long, overrides_with = "content")]
        no_content: bool,
        /// Print the map of the metadata context CONTEXT (default base:allocation; any the
        /// server offers, e.g. qemu:allocation-depth or qemu:dirty-bitmap:NAME): offset,
        /// length, type and description per extent, as nbdinfo prints them (base:allocation:
        /// 0 data, 1 hole, 2 zero, 3 hole,zero; qemu:allocation-depth: 0 absent, 1 local, N
        /// backing depth N; dirty bitmaps: 0 clean, 1 dirty); with --json, nbdinfo's JSON
        /// byte for byte (one object a line).
        #[arg(
            long,
            value_name = "CONTEXT",
            num_args = 0..=1,
            require_equals = true,
            default_missing_value = info::BASE_ALLOCATION,
            conflicts_with_all = ["can", "cannot"]
        )]
        map: Option<String>,
        /// With --map: bytes and percentage of the export per type instead of the extents.
        #[arg(long, requires = "map")]
        totals: bool,
        /// Exit 0 if the export or connection has FEATURE, 2 if not; print nothing. FEATURE:
        /// connect, read, write, read-only, rotational, tls, structured-reply,
        /// extended-headers, flush, fua, trim, zero, fast-zero, df, multi-conn, cache,
        /// base:allocation (alias extents).
        #[arg(
            long,
            visible_aliases = ["is", "has"],
            value_name = "FEATURE",
            conflicts_with = "cannot"
        )]
        can: Option<String>,
        /// Exit 0 if the export lacks FEATURE, 2 if it has it; print nothing.
        #[arg(long, visible_aliases = ["isnt", "hasnt"], value_name = "FEATURE")]
        cannot: Option<String>,
        /// Accepted, as nbdinfo's: the output has no colour to force.
        #[arg(long, visible_alias = "colour", overrides_with = "no_color")]
        color: bool,
        /// Accepted, as nbdinfo's: the output has no colour.
        #[arg(long, visible_alias = "no-colour", overrides_with = "color")]
        no_color: bool,
    },
    /// Grow or shrink an export to SIZE, through NBD's experimental RESIZE extension
    /// (NBD_CMD_RESIZE), where the server offers it: qpip-nbd-server offers it on writable
    /// rbd: exports (the image is resized as by rbd resize; a shrink is refused with EPERM
    /// while other clients use it). SIZE in bytes, or with a K, M, G or T suffix (powers of
    /// 1024), as rbd resize --size takes it.
    Resize {
        /// nbd://HOST[:PORT][/EXPORT] or nbd+unix:///EXPORT?socket=PATH
        uri: String,
        /// The new size: bytes, or N[K|M|G|T].
        #[arg(value_parser = qpip_cli::size::parse_size)]
        size: u64,
    },
    /// List a server's exports and their descriptions.
    List {
        /// nbd://HOST[:PORT] or nbd+unix:///?socket=PATH
        uri: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Copy SRC to DST; each is a local file (or block device) or an NBD URI.
    ///
    /// Holes of the source (block status on NBD, SEEK_DATA/SEEK_HOLE on files) are not read:
    /// a local destination is recreated sparse and keeps them as holes; an NBD destination
    /// gets WRITE_ZEROES (or zero writes if the server lacks it). A local destination file is
    /// truncated and sized to the source; an NBD destination must be at least as large.
    /// Blocks of allocated zeroes, standard input's included, are detected (-S) and zeroed
    /// (left as holes in a local file) instead of sent as data; with -S 0 they are written
    /// as data, allocated in a local file too, as nbdcopy does. The destination is made
    /// durable only with --flush, as with nbdcopy. A summary line follows on stderr; -q
    /// silences it. -V prints the version, as nbdcopy's.
    #[command(version)]
    Copy {
        /// Source: a file path, an NBD URI (nbd://, nbd+unix://, nbds://, nbds+unix://), or -
        /// for standard input
        src: String,
        /// Destination: a file path, an NBD URI, - for standard output, or null: to discard
        /// (a read benchmark)
        dst: String,
        /// Re-read both sides afterwards and compare; report the first differing offset.
        /// Sparse-aware, as qemu-img compare: ranges both sides report as zeroes (block
        /// status, SEEK_DATA) are not read; where one side does, the other must read as
        /// zeroes (--no-extents: both are read whole).
        #[arg(long)]
        verify: bool,
        /// Copy only the extents of the source whose flags in the metadata context CONTEXT
        /// are not 0 (qemu:dirty-bitmap:NAME: the dirty ones, for an incremental backup;
        /// qemu:allocation-depth: what the image or its backing chain holds); the rest of the
        /// destination is left as it is (a destination file is not truncated, only grown to
        /// the source's size). The source must be an export offering CONTEXT (qpip-nbd info
        /// --list shows them); nbdcopy has no such option.
        #[arg(long, value_name = "CONTEXT")]
        map: Option<String>,
        /// Copy holes as data: no block status, no zero detection, zeroes written as data
        /// (--no-extents -S 0 --allocated).
        #[arg(long)]
        no_sparse: bool,
        /// Make the destination durable before exiting: fsync a file, NBD FLUSH an export.
        /// Without it (nbdcopy's default) the copy ends once every write is acknowledged.
        #[arg(long)]
        flush: bool,
        /// The destination already reads as zeroes: zero ranges of the source are not
        /// written at all (unsafe otherwise). --target-is-zero is qemu-img's spelling.
        #[arg(long, visible_alias = "target-is-zero")]
        destination_is_zero: bool,
        /// Zero detection: aligned blocks of N bytes that read as zeroes are sent as
        /// WRITE_ZEROES (holes in a local file), not as data, standard input's too; 0 turns
        /// it off: zeroes are written as data (allocated in a local file). As nbdcopy's.
        #[arg(short = 'S', long = "sparse", value_name = "N", default_value_t = 4096)]
        sparse: u64,
        /// A fully allocated destination: zero ranges are written as data, not as holes.
        #[arg(long)]
        allocated: bool,
        /// Do not ask the source where its holes are (block status, SEEK_DATA): read it all
        /// (zero detection still applies).
        #[arg(long)]
        no_extents: bool,
        /// Connections per side when the servers allow multi-conn (one worker thread each).
        #[arg(short = 'C', long, default_value_t = 4, value_name = "N")]
        connections: usize,
        /// At most N workers, each a thread with a connection per side (nbdcopy's --threads;
        /// 0, the default, leaves it to --connections).
        #[arg(short = 'T', long, default_value_t = 0, value_name = "N")]
        threads: usize,
        /// Requests in flight per connection, 1..=64 (default 32; -R and --requests are
        /// nbdcopy's spellings).
        #[arg(
            short = 'R',
            long,
            visible_alias = "requests",
            value_name = "N",
            value_parser = clap::value_parser!(u16).range(1..=64)
        )]
        window: Option<u16>,
        /// The largest READ or WRITE request in bytes (nbdcopy's); above 1 MiB, the
        /// client's largest request, it is 1 MiB.
        #[arg(long, value_name = "N", value_parser = request_size)]
        request_size: Option<u32>,
        /// Bytes in flight per connection at most (nbdcopy's): the window becomes N divided
        /// by the request size, within 1..=64 and at most --requests. N in bytes or with a
        /// K, M or G suffix (1M).
        #[arg(long, value_name = "N", value_parser = qpip_cli::size::parse_size)]
        queue_size: Option<u64>,
        /// No parallelism (nbdcopy's): one connection per side, one request in flight, the
        /// blocks in order; slow, for servers that cannot take several requests at once.
        /// (Standard input and output are always streamed in order, on one connection.)
        #[arg(long)]
        synchronous: bool,
        /// Give up on a lost connection after this many seconds.
        #[arg(long, default_value_t = 30.0, value_name = "SECS")]
        reconnect_timeout: f64,
        /// No progress bar (it is shown only when stderr is a terminal anyway).
        #[arg(long, conflicts_with = "progress")]
        no_progress: bool,
        /// A progress bar even when stderr is not a terminal (nbdcopy's -p); with =FD,
        /// lines "PERCENT/100" written to file descriptor FD instead, as nbdcopy's
        /// --progress=FD.
        #[arg(
            short = 'p',
            long,
            value_name = "FD",
            num_args = 0..=1,
            require_equals = true
        )]
        progress: Option<Option<i32>>,
    },
}

fn human(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    format!("{v:.1} {}", units[i])
}

fn main() {
    qpip_cli::man::generate_if_asked(<Cli as clap::CommandFactory>::command);
    let cli = Cli::parse();
    cli.log
        .init("qpip-nbd", tracing_subscriber::filter::LevelFilter::WARN);
    match run(cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            qpip_cli::stdout::exit_if_closed(&e);
            eprintln!("qpip-nbd: {e:#}");
            std::process::exit(1);
        }
    }
}

/// Progress as plain lines, one per redraw and no cursor movement: on stderr where it is not
/// a terminal (`copy -p` into a log), or on the descriptor of `--progress=FD`.
struct ProgressLines(parking_lot::Mutex<Box<dyn Write + Send>>);

impl ProgressLines {
    fn stderr() -> ProgressLines {
        ProgressLines(parking_lot::Mutex::new(Box::new(std::io::stderr())))
    }
}

impl std::fmt::Debug for ProgressLines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProgressLines")
    }
}

impl TermLike for ProgressLines {
    fn width(&self) -> u16 {
        80
    }
    fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
        Ok(())
    }
    fn write_line(&self, s: &str) -> std::io::Result<()> {
        self.write_str(s)
    }
    fn write_str(&self, s: &str) -> std::io::Result<()> {
        // indicatif pads over the previous, longer line with spaces: no line of its own.
        let s = s.trim_end();
        if s.is_empty() {
            return Ok(());
        }
        writeln!(self.0.lock(), "{s}")
    }
    fn clear_line(&self) -> std::io::Result<()> {
        Ok(())
    }
    fn flush(&self) -> std::io::Result<()> {
        self.0.lock().flush()
    }
}

/// Client options on the NIC that `--backend` names (clients take the first free lanai node
/// unless `--lanai-node` names one).
fn client_options(args: &NicArgs) -> Result<ClientOptions> {
    let nic = Nic::open(args.choice(None)?)
        .with_context(|| format!("starting the {} NIC", args.kind.name()))?;
    Ok(ClientOptions {
        nic: Some(nic),
        ..Default::default()
    })
}

/// Runs the command; the exit status (2: `info --can/--is` answered no).
fn run(cli: Cli) -> Result<i32> {
    let base = client_options(&cli.nic)?;
    // -q: no summary line after a copy (nbdcopy prints none).
    let quiet = cli.log.quiet > 0;
    match cli.cmd {
        Cmd::Info {
            uri,
            json,
            size,
            list,
            content,
            no_content,
            map,
            totals,
            can,
            cannot,
            // No colour to force or to take away.
            color: _,
            no_color: _,
        } => info::run(
            &info::InfoArgs {
                uri,
                json,
                size,
                list,
                content: if content {
                    Some(true)
                } else if no_content {
                    Some(false)
                } else {
                    None
                },
                map,
                totals,
                question: can.map(|c| (c, false)).or(cannot.map(|c| (c, true))),
            },
            &base,
        ),
        Cmd::List { uri, json } => list(&uri, json, &base),
        Cmd::Resize { uri, size } => {
            let mut c = Client::connect_with(&uri, base)?;
            let old = c.size();
            if !c.can_resize() {
                anyhow::bail!("{uri} does not offer NBD's RESIZE extension");
            }
            c.resize(size)
                .with_context(|| format!("resizing {uri} from {old} to {size} bytes"))?;
            c.disconnect()?;
            Ok(0)
        }
        Cmd::Copy {
            src,
            dst,
            verify,
            map,
            no_sparse,
            flush,
            destination_is_zero,
            sparse,
            allocated,
            no_extents,
            connections,
            threads,
            window,
            request_size,
            queue_size,
            synchronous,
            reconnect_timeout,
            no_progress,
            progress,
        } => {
            // --queue-size over the request size: the window it allows.
            let by_queue = queue_size.map(|q| {
                let req = u64::from(request_size.unwrap_or(nbd_client::MAX_IO as u32))
                    .min(nbd_client::MAX_IO as u64);
                (q / req).clamp(1, nbd_client::MAX_WINDOW as u64) as usize
            });
            let window = match (window.map(usize::from), by_queue) {
                _ if synchronous => 1,
                (Some(w), Some(q)) => w.min(q),
                (w, q) => w.or(q).unwrap_or(32),
            };
            let connections = if synchronous { 1 } else { connections };
            let progress = copy_progress(no_progress, progress)?;
            let allocated = allocated || no_sparse;
            let opts = copy::CopyOptions {
                extents: !(no_extents || no_sparse),
                detect_zeroes: if allocated { 0 } else { sparse },
                allocated,
                destination_is_zero,
                flush,
                verify,
                stop: copy::stop_on_signals()?,
                connections,
                threads,
                client: ClientOptions {
                    window,
                    max_request: request_size,
                    reconnect_timeout: Duration::try_from_secs_f64(reconnect_timeout)
                        .context("--reconnect-timeout")?,
                    ..base
                },
                map,
                progress,
            };
            let (s, d) = (copy::Endpoint::parse(&src), copy::Endpoint::parse(&dst));
            let t = Instant::now();
            let stats = match copy::copy(&s, &d, &opts) {
                Ok(stats) => stats,
                Err(e) => {
                    if let Some(i) = e.downcast_ref::<copy::Interrupted>() {
                        eprintln!("qpip-nbd: copying {} to {}: {i}", s.name(), d.name());
                        return Ok(128 + i.signal);
                    }
                    // A side that cannot be reached is named by the error itself.
                    if info::names_uri(&e) {
                        return Err(e);
                    }
                    return Err(e.context(format!("copying {} to {}", s.name(), d.name())));
                }
            };
            let secs = t.elapsed().as_secs_f64();
            if quiet {
                return Ok(0);
            }
            eprintln!(
                "copied {} ({} data, {} zero/holes) in {secs:.2} s over {} connection(s){}{}",
                human(stats.size),
                human(stats.data_bytes),
                human(stats.zero_bytes),
                stats.connections,
                if stats.reconnects > 0 {
                    format!(", {} reconnect(s)", stats.reconnects)
                } else {
                    String::new()
                },
                if verify { ", verified" } else { "" }
            );
            Ok(0)
        }
    }
}

/// `qpip-nbd list`: the exports the server at `uri` names, as text or JSON.
fn list(uri: &str, json: bool, base: &ClientOptions) -> Result<i32> {
    let list =
        Client::list_with(uri, base).map_err(|e| info::in_context(e, "listing exports of", uri))?;
    if json {
        let v: Vec<_> = list
            .iter()
            .map(|e| serde_json::json!({"name": e.name, "description": e.description}))
            .collect();
        outln!("{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        for e in &list {
            // Text from the server: escaped before it reaches the terminal (JSON
            // output escapes it by itself).
            let name = printable(e.name.as_bytes());
            if e.description.is_empty() {
                outln!("{name}")?;
            } else {
                outln!("{name}\t{}", printable(e.description.as_bytes()))?;
            }
        }
    }
    Ok(0)
}

/// `--request-size N`: bytes, or with a K or M suffix (nbdcopy takes 1M), 512 to 32 MiB.
fn request_size(s: &str) -> Result<u32, String> {
    let n = qpip_cli::size::parse_size(s).map_err(|e| e.to_string())?;
    u32::try_from(n)
        .ok()
        .filter(|n| (512..=32 << 20).contains(n))
        .ok_or_else(|| format!("{s}: give 512 bytes to 32M"))
}

/// The progress bar of a copy: none with --no-progress or where stderr is no terminal (unless
/// --progress asks for one); with --progress=FD, nbdcopy's "PERCENT/100" lines on FD.
fn copy_progress(no_progress: bool, progress: Option<Option<i32>>) -> Result<ProgressBar> {
    let (target, template) = match progress {
        _ if no_progress => return Ok(ProgressBar::hidden()),
        Some(Some(fd)) => {
            // SAFETY: F_GETFD only asks whether `fd` is open.
            if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
                anyhow::bail!("--progress={fd}: file descriptor {fd} is not open");
            }
            // SAFETY: the user handed the descriptor to this process for the progress
            // lines; nothing else here uses it.
            let file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
            let lines = ProgressLines(parking_lot::Mutex::new(Box::new(file)));
            (
                ProgressDrawTarget::term_like_with_hz(Box::new(lines), 1),
                "{percent}/100",
            )
        }
        // Drawn even where stderr is no terminal, at most once a second.
        Some(None) => (
            ProgressDrawTarget::term_like_with_hz(Box::new(ProgressLines::stderr()), 1),
            BAR,
        ),
        None if std::io::stderr().is_terminal() => (ProgressDrawTarget::stderr(), BAR),
        None => return Ok(ProgressBar::hidden()),
    };
    const BAR: &str = "{bytes}/{total_bytes} [{wide_bar}] {binary_bytes_per_sec} eta {eta}";
    let pb = ProgressBar::with_draw_target(Some(0), target);
    pb.set_style(
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    Ok(pb)
}
