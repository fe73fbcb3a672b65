//! qpip-bench: measures the QPIP stack against kernel sockets and socket NBD stacks, side by
//! side in one run.

mod cpu;
mod micro;

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
    }
    Ok(())
}
