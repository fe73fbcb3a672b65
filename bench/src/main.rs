//! qpip-bench: measures the QPIP stack against kernel sockets and socket NBD stacks, side by
//! side in one run.

mod cpu;
mod micro;
mod nbd;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "qpip-bench",
    version,
    about = "Benchmarks of the QPIP stack, each side by side with its peer in one run"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// QP verbs against kernel sockets: host overhead per 1-byte message, round-trip time over
    /// TCP and UDP, ttcp throughput (10 MB in 16 KiB messages; 1 GiB in 128 KiB messages) with
    /// application and NIC-engine CPU per GB.
    Micro {
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// Runs per measure; medians are reported.
        #[arg(long, default_value_t = 5)]
        repeat: usize,
        /// Smaller counts (seconds instead of minutes), for smoke tests.
        #[arg(long)]
        quick: bool,
    },
    /// NBD servers side by side: qpip-nbd-server, nbdkit and qemu-nbd, with fio's nbd engine
    /// as the client of all three.
    Nbd {
        #[command(subcommand)]
        cmd: NbdCmd,
    },
}

#[derive(Subcommand)]
enum NbdCmd {
    /// Sequential write then read of a sparse raw image (default 1 GiB in 256 KiB requests,
    /// 16 in flight): MB/s, server CPU per GB and fio CPU per GB for each server.
    Raw {
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// Rounds; every round runs all servers (interleaved); medians and min/max are reported.
        #[arg(long, default_value_t = 3)]
        repeat: usize,
        /// Image size and bytes moved per pass (k, M, G, T: binary units).
        #[arg(long, default_value = "1G", value_parser = nbd::parse_size)]
        size: u64,
        /// Request size.
        #[arg(long, default_value = "256k", value_parser = nbd::parse_size)]
        bs: u64,
        /// Requests in flight.
        #[arg(long, default_value_t = 16)]
        iodepth: u32,
        /// The qpip-nbd-server to measure. Default: the one next to this executable.
        #[arg(long, value_name = "PATH")]
        server_bin: Option<PathBuf>,
        /// Directory for the image files. Default: a fresh temporary directory. The images
        /// are deleted afterwards either way.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
        /// Write each image once, untimed, before the timed write pass: the timed pass then
        /// overwrites cached blocks. Removes the cost of allocating fresh page-cache pages
        /// (large and erratic in VMs whose memory the host backs lazily) from the comparison.
        #[arg(long)]
        prewrite: bool,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Micro {
            json,
            repeat,
            quick,
        } => {
            let sizes = if quick {
                micro::MicroSizes::quick()
            } else {
                micro::MicroSizes::full()
            };
            let progress = |s: &str| eprintln!("qpip-bench micro: {s}");
            let report = micro::run(repeat, sizes, &progress)?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{}", micro::table(&report));
            }
        }
        Cmd::Nbd {
            cmd:
                NbdCmd::Raw {
                    json,
                    repeat,
                    size,
                    bs,
                    iodepth,
                    server_bin,
                    dir,
                    prewrite,
                },
        } => {
            let server_bin = match server_bin {
                Some(p) => p,
                None => nbd::default_server_bin()?,
            };
            let progress = |s: &str| eprintln!("qpip-bench nbd raw: {s}");
            let report = nbd::run(
                size,
                bs,
                iodepth,
                repeat,
                server_bin,
                dir.as_deref(),
                prewrite,
                &progress,
            )?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{}", nbd::table(&report));
            }
        }
    }
    Ok(())
}
