//! A second host for the tests that need a link: a network namespace joined to the test's
//! by a veth pair, made with `ip` (root) and removed by its guard. The link can be taken down
//! and up again from our side.

use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::process::Command;

use crate::ci::{have, missing, root};

/// The namespace `qpip-test-PID-N` and its veth pair; removed on drop.
pub struct Netns {
    /// The namespace's name (`ip netns exec NAME`, `/run/netns/NAME`).
    pub name: String,
    /// Our end of the pair.
    pub host_if: String,
    /// Our end's address.
    pub host_ip: String,
    /// The namespace's address.
    pub ns_ip: String,
    /// The namespace's end of the pair.
    pub ns_if: String,
}

/// Runs `ip ARGS`: its stderr if it fails.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Netns {
    /// A namespace joined by a veth pair of `mtu` bytes, the link up; None (under the CI
    /// rule) where namespaces cannot be made: not root, no `ip`, or a kernel that refuses.
    pub fn create(mtu: u32) -> Option<Netns> {
        if !root("network namespaces need it") || !have("ip") {
            return None;
        }
        use std::sync::atomic::{AtomicU32, Ordering};
        static N: AtomicU32 = AtomicU32::new(0);
        let (pid, n) = (std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        // A /30 of its own per namespace (10.78: qpip-bench's --netns uses 10.77); interface
        // names have at most 15 bytes.
        let id = pid.wrapping_mul(8).wrapping_add(n) % 16_384;
        let (hi, lo) = (id / 64, id % 64 * 4);
        let ns = Netns {
            name: format!("qpip-test-{pid}-{n}"),
            host_if: format!("qt{id}a"),
            host_ip: format!("10.78.{hi}.{}", lo + 1),
            ns_ip: format!("10.78.{hi}.{}", lo + 2),
            ns_if: format!("qt{id}b"),
        };
        if let Err(e) = ip(&["netns", "add", &ns.name]) {
            missing(&format!("network namespaces ({e})"));
            return None;
        }
        let mtu = mtu.to_string();
        let ns_if = ns.ns_if.clone();
        let steps: [&[&str]; 6] = [
            &[
                "link",
                "add",
                &ns.host_if,
                "mtu",
                &mtu,
                "type",
                "veth",
                "peer",
                "name",
                &ns_if,
                "mtu",
                &mtu,
                "netns",
                &ns.name,
            ],
            &[
                "addr",
                "add",
                &format!("{}/30", ns.host_ip),
                "dev",
                &ns.host_if,
            ],
            &["link", "set", &ns.host_if, "up"],
            &[
                "-n",
                &ns.name,
                "addr",
                "add",
                &format!("{}/30", ns.ns_ip),
                "dev",
                &ns_if,
            ],
            &["-n", &ns.name, "link", "set", &ns_if, "up"],
            &["-n", &ns.name, "link", "set", "lo", "up"],
        ];
        for args in steps {
            if let Err(e) = ip(args) {
                missing(&format!("a veth link into a network namespace ({e})"));
                return None;
            }
        }
        Some(ns)
    }

    /// Makes `cmd` start inside the namespace (setns(2) in the child before exec).
    pub fn enter(&self, cmd: &mut Command) {
        let path = format!("/run/netns/{}", self.name);
        let f = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        // SAFETY: setns is async-signal-safe; the closure only reads its own fd.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }

    /// Takes the link down (`up` false) or up again at the namespace's end, as a cable
    /// pulled out there: our end keeps its route (packets to the namespace are dropped, not
    /// sent to our default gateway, as with our end down).
    pub fn set_link(&self, up: bool) {
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.name, "link", "set", "dev", &self.ns_if, state]).unwrap();
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Deleting one end deletes the pair, even while a process still holds the namespace.
        let _ = ip(&["link", "del", &self.host_if]);
        let _ = ip(&["netns", "del", &self.name]);
    }
}
