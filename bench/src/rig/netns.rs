//! `--netns`: the server side of an experiment (micro: the echo side) in a network namespace
//! of its own, joined to ours by a veth pair of a chosen MTU: a second host across a link,
//! where loopback has a 64 KiB MTU and no segmentation. Made with `ip` (root) for the run and
//! removed by its guard, or by the signal watchers when a signal ends the run.

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::Mutex;

use anyhow::{Context, Result, bail};
use serde::Serialize;

/// `--netns` and `--mtu`, for every experiment that has a server side.
#[derive(clap::Args, Clone, Copy, Debug)]
pub(crate) struct NetnsArgs {
    /// (root) Run the servers (micro: the echo side) in a network namespace of their own,
    /// reached over a veth pair (here 10.77.N.1/24, there 10.77.N.2) instead of loopback.
    /// The namespace and the pair are made for the run and removed after it.
    #[arg(long)]
    pub netns: bool,
    /// The veth pair's MTU with --netns (e.g. 1500 or 9000).
    #[arg(long, default_value_t = 1500, requires = "netns",
          value_parser = clap::value_parser!(u32).range(68..=65535))]
    pub mtu: u32,
}

impl NetnsArgs {
    /// The namespace asked for, made; None without --netns.
    pub(crate) fn create(self) -> Result<Option<Netns>> {
        if self.netns {
            Netns::create(self.mtu).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// Where the server side runs: its namespace and the link's addresses.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Side {
    pub namespace: String,
    pub mtu: u32,
    /// The address on our side (the clients').
    pub host_ip: Ipv4Addr,
    /// The address in the namespace (the servers').
    pub ns_ip: Ipv4Addr,
}

impl Side {
    /// Makes `cmd` start inside the namespace: setns(2) in the child before exec (the
    /// process keeps its pid and program, for CPU accounting and messages).
    pub(crate) fn enter(&self, cmd: &mut Command) -> Result<()> {
        let path = format!("/run/netns/{}", self.namespace);
        let ns = std::fs::File::open(&path)
            .with_context(|| format!("opening the network namespace {path}"))?;
        // SAFETY: setns is async-signal-safe and the closure only reads its own fd.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        Ok(())
    }
}

/// The namespace and its veth pair, removed on drop.
pub(crate) struct Netns {
    pub side: Side,
    host_if: String,
}

/// The namespace and host interface of this run, for the signal watchers.
static ACTIVE: Mutex<Option<(String, String)>> = Mutex::new(None);

impl Netns {
    /// Makes namespace `qpip-bench-PID` and a veth pair of `mtu` bytes between it and ours.
    pub(crate) fn create(mtu: u32) -> Result<Netns> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            bail!("--netns needs root: it makes a network namespace and a veth pair");
        }
        if super::in_path("ip").is_none() {
            bail!("--netns needs the ip command (package iproute2): not found in PATH");
        }
        let pid = std::process::id();
        let net = (pid % 250 + 1) as u8;
        let namespace = format!("qpip-bench-{pid}");
        // Interface names have at most 15 bytes; pids at most 7 digits.
        let (host_if, ns_if) = (format!("qb{pid}a"), format!("qb{pid}b"));
        let side = Side {
            namespace: namespace.clone(),
            mtu,
            host_ip: Ipv4Addr::new(10, 77, net, 1),
            ns_ip: Ipv4Addr::new(10, 77, net, 2),
        };
        ip(&["netns", "add", &namespace])?;
        let guard = Netns {
            side,
            host_if: host_if.clone(),
        };
        *ACTIVE.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((namespace.clone(), host_if.clone()));
        let mtu = mtu.to_string();
        ip(&[
            "link", "add", &host_if, "mtu", &mtu, "type", "veth", "peer", "name", &ns_if, "mtu",
            &mtu, "netns", &namespace,
        ])?;
        let host = format!("{}/24", guard.side.host_ip);
        let there = format!("{}/24", guard.side.ns_ip);
        ip(&["addr", "add", &host, "dev", &host_if])?;
        ip(&["link", "set", &host_if, "up"])?;
        ip(&["-n", &namespace, "addr", "add", &there, "dev", &ns_if])?;
        ip(&["-n", &namespace, "link", "set", &ns_if, "up"])?;
        ip(&["-n", &namespace, "link", "set", "lo", "up"])?;
        Ok(guard)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        ACTIVE.lock().unwrap_or_else(|e| e.into_inner()).take();
        remove(&self.side.namespace, &self.host_if);
    }
}

/// Removes the run's namespace and veth pair, if any (from a signal watcher, which exits
/// without running guards).
pub(crate) fn remove_active() {
    if let Some((ns, host_if)) = ACTIVE.lock().unwrap_or_else(|e| e.into_inner()).take() {
        remove(&ns, &host_if);
    }
}

/// For runs with no other signal watcher: a signal removes the namespace and exits with
/// `note` (guards do not run when a signal ends the process; children die with us).
pub(crate) fn clean_up_on_signals(note: &'static str) -> Result<()> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP])
        .context("installing signal handlers")?;
    std::thread::spawn(move || {
        if let Some(sig) = signals.forever().next() {
            remove_active();
            eprintln!("{note}; network namespace removed");
            std::process::exit(128 + sig);
        }
    });
    Ok(())
}

fn remove(namespace: &str, host_if: &str) {
    // Deleting one end deletes the pair at once, even while a process still holds the
    // namespace.
    let _ = ip(&["link", "del", host_if]);
    if let Err(e) = ip(&["netns", "del", namespace]) {
        eprintln!("qpip-bench: {e:#}");
    }
}

/// Runs `ip ARGS`; its stderr is the error.
fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running ip (package iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
