//! qpip-nbd: inspect NBD exports and copy between local files and NBD exports, over Queue
//! Pair IP.

mod copy;

use nbd_proto::peer_text::printable;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use nbd_client::{Client, ClientOptions, ExportInfo};
use nbd_proto::flags::TransmissionFlags as TF;
use qpip_cli::BackendArgs;
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
        default. nbd+unix:// is not supported: QPs carry TCP and UDP only.\n\n\
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
    /// Log level (error, warn, info, debug, trace); RUST_LOG overrides.
    #[arg(long, global = true, default_value = "warn")]
    log: String,
    #[command(flatten)]
    backend: BackendArgs,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Show an export's size, flags, block sizes and description.
    Info {
        /// nbd://HOST[:PORT][/EXPORT]
        uri: String,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// List a server's exports and their descriptions.
    List {
        /// nbd://HOST[:PORT]
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
    Copy {
        /// Source: a file path or nbd://HOST[:PORT]/EXPORT
        src: String,
        /// Destination: a file path or nbd://HOST[:PORT]/EXPORT
        dst: String,
        /// Re-read both sides afterwards and compare; report the first differing offset.
        #[arg(long)]
        verify: bool,
        /// Copy holes as data (no block status, no WRITE_ZEROES).
        #[arg(long)]
        no_sparse: bool,
        /// Connections per side when the servers allow multi-conn.
        #[arg(short = 'C', long, default_value_t = 4, value_name = "N")]
        connections: usize,
        /// Requests in flight per connection (1..=64).
        #[arg(long, default_value_t = 32, value_name = "N")]
        window: usize,
        /// Give up on a lost connection after this many seconds.
        #[arg(long, default_value_t = 30.0, value_name = "SECS")]
        reconnect_timeout: f64,
        /// No progress bar (it is shown only when stderr is a terminal anyway).
        #[arg(long)]
        no_progress: bool,
    },
}

const FLAG_NAMES: &[(TF, &str)] = &[
    (TF::READ_ONLY, "read-only"),
    (TF::SEND_FLUSH, "flush"),
    (TF::SEND_FUA, "fua"),
    (TF::ROTATIONAL, "rotational"),
    (TF::SEND_TRIM, "trim"),
    (TF::SEND_WRITE_ZEROES, "write-zeroes"),
    (TF::SEND_DF, "df"),
    (TF::CAN_MULTI_CONN, "multi-conn"),
    (TF::SEND_RESIZE, "resize"),
    (TF::SEND_CACHE, "cache"),
    (TF::SEND_FAST_ZERO, "fast-zero"),
];

fn flag_names(f: TF) -> Vec<&'static str> {
    FLAG_NAMES
        .iter()
        .filter(|(b, _)| f.contains(*b))
        .map(|(_, n)| *n)
        .collect()
}

fn print_info(uri: &str, info: &ExportInfo, json: bool) -> Result<()> {
    let bs = info.block_size;
    if json {
        let v = serde_json::json!({
            "uri": uri,
            "size": info.size,
            "flags": flag_names(info.flags),
            "flags_raw": info.flags.bits(),
            "block_size": {
                "minimum": bs.min,
                "preferred": bs.preferred,
                "maximum": bs.max,
                "advertised": info.block_size_advertised,
            },
            "name": info.name,
            "description": info.description,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("uri:         {uri}");
        if let Some(n) = &info.name {
            println!("name:        {}", printable(n.as_bytes()));
        }
        println!("size:        {} ({})", info.size, human(info.size));
        println!("flags:       {}", flag_names(info.flags).join(" "));
        println!(
            "block size:  minimum {} preferred {} maximum {}{}",
            bs.min,
            bs.preferred,
            bs.max,
            if info.block_size_advertised {
                ""
            } else {
                " (defaults: not advertised)"
            }
        );
        if let Some(d) = info.description.as_deref().filter(|d| !d.is_empty()) {
            println!("description: {}", printable(d.as_bytes()));
        }
    }
    Ok(())
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
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cli.log)),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let Err(e) = run(cli) {
        eprintln!("qpip-nbd: {e:#}");
        std::process::exit(1);
    }
}

/// Client options on the NIC that `--backend` names (clients take the first free lanai node
/// unless `--lanai-node` names one).
fn client_options(args: &BackendArgs) -> Result<ClientOptions> {
    let nic = Nic::open(args.backend(None)?)
        .with_context(|| format!("starting the {} NIC", args.backend.name()))?;
    Ok(ClientOptions {
        nic: Some(nic),
        ..Default::default()
    })
}

fn run(cli: Cli) -> Result<()> {
    let base = client_options(&cli.backend)?;
    match cli.cmd {
        Cmd::Info { uri, json } => {
            let info = Client::info_with(&uri, &base).with_context(|| format!("querying {uri}"))?;
            print_info(&uri, &info, json)
        }
        Cmd::List { uri, json } => {
            let list = Client::list_with(&uri, &base)
                .with_context(|| format!("listing exports of {uri}"))?;
            if json {
                let v: Vec<_> = list
                    .iter()
                    .map(|e| serde_json::json!({"name": e.name, "description": e.description}))
                    .collect();
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                for e in &list {
                    // Text from the server: escaped before it reaches the terminal (JSON
                    // output escapes it by itself).
                    let name = printable(e.name.as_bytes());
                    if e.description.is_empty() {
                        println!("{name}");
                    } else {
                        println!("{name}\t{}", printable(e.description.as_bytes()));
                    }
                }
            }
            Ok(())
        }
        Cmd::Copy {
            src,
            dst,
            verify,
            no_sparse,
            connections,
            window,
            reconnect_timeout,
            no_progress,
        } => {
            let progress = if no_progress || !std::io::stderr().is_terminal() {
                ProgressBar::hidden()
            } else {
                let pb = ProgressBar::new(0);
                pb.set_style(
                    ProgressStyle::with_template(
                        "{bytes}/{total_bytes} [{wide_bar}] {binary_bytes_per_sec} eta {eta}",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
                );
                pb
            };
            let opts = copy::CopyOptions {
                sparse: !no_sparse,
                verify,
                connections,
                client: ClientOptions {
                    window,
                    reconnect_timeout: Duration::try_from_secs_f64(reconnect_timeout)
                        .context("--reconnect-timeout")?,
                    ..base
                },
                progress,
            };
            let (s, d) = (copy::Endpoint::parse(&src), copy::Endpoint::parse(&dst));
            let t = Instant::now();
            let stats = copy::copy(&s, &d, &opts)
                .with_context(|| format!("copying {} to {}", s.name(), d.name()))?;
            let secs = t.elapsed().as_secs_f64();
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
            Ok(())
        }
    }
}
