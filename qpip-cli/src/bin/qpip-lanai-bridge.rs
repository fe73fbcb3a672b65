//! qpip-lanai-bridge: joins the host kernel's IPv6 stack to the emulated Myrinet fabric
//! through a TUN device, so ordinary socket programs reach QPs on the lanai backend.

// The doc comments of the options are clap's --help text, where brackets are literal
// ("[::1]", "nbd://HOST[:PORT]/EXPORT"), not links.
#![allow(rustdoc::broken_intra_doc_links)]

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use anyhow::{Context, Result};
use clap::Parser;
use qpip_core::lanai::FabricParams;
use qpip_core::lanai::bridge::Bridge;

#[derive(Parser, Debug)]
#[command(
    name = "qpip-lanai-bridge",
    version,
    about = "Bridge the host's IPv6 stack onto the emulated LANai/Myrinet fabric (needs root)",
    long_about = "Bridge the host's IPv6 stack onto the emulated LANai/Myrinet fabric.\n\n\
        Creates a TUN device (the fabric config's [bridge].tun), gives the kernel the \
        address [bridge].host_addr with the fabric's prefix, sets the fabric MTU and brings \
        it up. IPv6 packets the kernel sends to a fabric node become Myrinet frames toward \
        that node's port; frames for the bridge's port are handed to the kernel. Anything \
        else (multicast, other prefixes) is dropped. The device goes away on SIGINT/SIGTERM.\n\n\
        Needs CAP_NET_ADMIN (root) and iproute2's `ip`.",
    after_help = "Example:\n  \
        qpip-nbd-server --backend lanai &\n  \
        qpip-lanai-bridge &\n  \
        qemu-io -f raw -c 'read -v 0 512' 'nbd://[fd00:4c41:4e41::1]:10809/demo'"
)]
struct Cli {
    /// The fabric config. Default: the embedded configs/fabric.toml.
    #[arg(long, value_name = "FILE")]
    fabric: Option<PathBuf>,
    /// The TUN device's name (default: [bridge].tun of the fabric config).
    #[arg(long, value_name = "NAME")]
    tun: Option<String>,
    #[command(flatten)]
    log: qpip_cli::logging::LogArgs,
}

fn main() {
    qpip_cli::man::generate_if_asked(<Cli as clap::CommandFactory>::command);
    let cli = Cli::parse();
    cli.log.init(
        "qpip-lanai-bridge",
        tracing_subscriber::filter::LevelFilter::INFO,
    );
    if let Err(e) = run(cli) {
        eprintln!("qpip-lanai-bridge: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    let fabric = match &cli.fabric {
        Some(p) => FabricParams::load(p)?,
        None => FabricParams::default(),
    };
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone()).context("installing signal handlers")?;
    }
    let mut bridge = Bridge::open(fabric, cli.tun.as_deref())?;
    // On stderr with the log: stdout carries no status.
    eprintln!("qpip-lanai-bridge: {} up", bridge.tun_name());
    // Dropping the bridge (also after an error) closes the TUN device, which removes it.
    bridge.run(&stop)?;
    Ok(())
}
