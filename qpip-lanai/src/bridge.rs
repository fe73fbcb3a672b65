//! The TUN bridge: the fabric's port to the host kernel's own IPv6 stack.
//!
//! A TUN device carries the fabric's prefix (the kernel holds `host_addr/prefix_len` on
//! it). IPv6 packets the kernel routes there become Myrinet frames toward the node that owns
//! the destination; frames arriving at the bridge's switch port (addresses no node owns) are
//! written to the TUN device. So the kernel's TCP — qemu-io, nbdinfo, the Linux NBD client —
//! reaches QPs in the firmware.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Command as Process;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::frame::{self, summary};
use super::params::{BridgeParams, FabricParams};

/// Why the bridge could not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BridgeError {
    /// The fabric has no bridge node to be.
    #[error("the fabric config has no [bridge] section")]
    NoBridge,
    /// The bridge node has nowhere to receive the fabric's frames.
    #[error("the bridge has no UDP port in the fabric config")]
    NoPort,
    /// The kernel takes interface names of 1 to 15 bytes.
    #[error("TUN device name {0:?} is empty or longer than 15 bytes")]
    BadName(String),
    /// /dev/net/tun could not be opened (no TUN support, or not root).
    #[error("opening /dev/net/tun for {dev}: {source}")]
    Open {
        /// The TUN device's name.
        dev: String,
        /// What the kernel said.
        source: io::Error,
    },
    /// The kernel refused to create the TUN device (TUNSETIFF).
    #[error("creating TUN device {dev}: {source}")]
    Create {
        /// The TUN device's name.
        dev: String,
        /// What the kernel said.
        source: io::Error,
    },
    /// Bringing the device up or giving it its address and MTU failed.
    #[error("configuring TUN device {dev}: `{cmd}` failed: {why}")]
    Configure {
        /// The TUN device's name.
        dev: String,
        /// The `ip` command that failed.
        cmd: String,
        /// Its exit status and output.
        why: String,
    },
    /// The bridge's fabric port could not be bound or failed.
    #[error("bridge port {addr}: {source}")]
    Port {
        /// The port's address.
        addr: SocketAddr,
        /// What the socket said.
        source: io::Error,
    },
    /// Reading or writing the TUN device failed.
    #[error("TUN device {dev}: {source}")]
    Io {
        /// The TUN device's name.
        dev: String,
        /// What the kernel said.
        source: io::Error,
    },
}

/// A TUN device (IFF_TUN | IFF_NO_PI: bare IP packets). It disappears when dropped: it is
/// not persistent, so closing its descriptor tears it down.
pub(crate) struct Tun {
    file: std::fs::File,
    name: String,
}

#[repr(C)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

impl Tun {
    /// Creates the device `name`.
    pub(crate) fn create(name: &str) -> Result<Tun, BridgeError> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains('\0') {
            return Err(BridgeError::BadName(name.into()));
        }
        let path = c"/dev/net/tun";
        // SAFETY: a valid NUL-terminated path; the result is checked.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(BridgeError::Open {
                dev: name.into(),
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: fd was just opened and is owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut req = IfReq {
            name: [0; libc::IFNAMSIZ],
            flags: (libc::IFF_TUN | libc::IFF_NO_PI) as libc::c_short,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: TUNSETIFF reads and writes an ifreq, which IfReq lays out (40 bytes).
        if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
            return Err(BridgeError::Create {
                dev: name.into(),
                source: io::Error::last_os_error(),
            });
        }
        Ok(Tun {
            file: std::fs::File::from(fd),
            name: name.into(),
        })
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// MTU, the kernel's address and prefix route, link up (with iproute2's `ip`).
    pub(crate) fn configure(
        &self,
        mtu: usize,
        addr: Ipv6Addr,
        prefix_len: u8,
    ) -> Result<(), BridgeError> {
        let dev = self.name.as_str();
        let mtu = mtu.to_string();
        let cidr = format!("{addr}/{prefix_len}");
        // nodad: the address is usable at once (nobody else is on this link to clash with).
        let steps: [&[&str]; 3] = [
            &["link", "set", "dev", dev, "mtu", &mtu],
            &["-6", "addr", "add", &cidr, "dev", dev, "nodad"],
            &["link", "set", "dev", dev, "up"],
        ];
        for args in steps {
            let cmd = format!("ip {}", args.join(" "));
            let out =
                Process::new("ip")
                    .args(args)
                    .output()
                    .map_err(|e| BridgeError::Configure {
                        dev: dev.into(),
                        cmd: cmd.clone(),
                        why: e.to_string(),
                    })?;
            if !out.status.success() {
                return Err(BridgeError::Configure {
                    dev: dev.into(),
                    cmd,
                    why: String::from_utf8_lossy(&out.stderr).trim().to_string(),
                });
            }
        }
        Ok(())
    }
}

/// What a packet from the kernel is, for forwarding.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Outbound<'a> {
    /// To this fabric node, along this route.
    Node { dst: Ipv6Addr, route: &'a [u8] },
    /// Not unicast IPv6 to a node (MLD, router solicitations, other prefixes): dropped.
    Drop(&'static str),
}

/// Classifies an IP packet the kernel wrote to the TUN device.
pub(crate) fn classify<'a>(fabric: &'a FabricParams, packet: &[u8]) -> Outbound<'a> {
    if packet.len() < 40 || packet[0] >> 4 != 6 {
        return Outbound::Drop("not IPv6");
    }
    let mut dst = [0u8; 16];
    dst.copy_from_slice(&packet[24..40]);
    let dst = Ipv6Addr::from(dst);
    if dst.is_multicast() {
        return Outbound::Drop("multicast");
    }
    match fabric.node_by_addr(&dst) {
        Some(n) => Outbound::Node {
            dst,
            route: &n.route,
        },
        None => Outbound::Drop("no fabric node has the destination"),
    }
}

/// The running bridge: TUN device plus the bridge's switch port.
pub struct Bridge {
    fabric: FabricParams,
    params: BridgeParams,
    tun: Tun,
    sock: mio::net::UdpSocket,
    routes: HashMap<u8, SocketAddr>,
}

const TUN: mio::Token = mio::Token(0);
const PORT: mio::Token = mio::Token(1);

impl Bridge {
    /// Creates and configures the TUN device (`tun` overrides `[bridge].tun`) and binds the
    /// bridge's UDP port.
    pub fn open(fabric: FabricParams, tun: Option<&str>) -> Result<Bridge, BridgeError> {
        let mut params = fabric.bridge.clone().ok_or(BridgeError::NoBridge)?;
        if let Some(t) = tun {
            params.tun = t.into();
        }
        let addr = params.port.ok_or(BridgeError::NoPort)?;
        let std_sock =
            std::net::UdpSocket::bind(addr).map_err(|source| BridgeError::Port { addr, source })?;
        let sref = socket2::SockRef::from(&std_sock);
        let _ = sref.set_recv_buffer_size(4 << 20);
        let _ = sref.set_send_buffer_size(4 << 20);
        std_sock
            .set_nonblocking(true)
            .map_err(|source| BridgeError::Port { addr, source })?;
        let tun = Tun::create(&params.tun)?;
        // Dropping `tun` on error removes the half-configured device.
        tun.configure(fabric.mtu, params.host_addr, params.prefix_len)?;
        set_nonblocking(&tun)?;
        tracing::info!(
            tun = %params.tun,
            host = %params.host_addr,
            prefix_len = params.prefix_len,
            port = %addr,
            "bridge up"
        );
        Ok(Bridge {
            routes: fabric.crossbar(),
            fabric,
            params,
            tun,
            sock: mio::net::UdpSocket::from_std(std_sock),
        })
    }

    /// The name of the TUN device the bridge made (the host's side of the fabric).
    pub fn tun_name(&self) -> &str {
        self.tun.name()
    }

    /// Forwards both ways until `stop` is set (the caller's signal handler) or I/O fails.
    pub fn run(&mut self, stop: &Arc<AtomicBool>) -> Result<(), BridgeError> {
        let dev = self.params.tun.clone();
        let io_err = |source| BridgeError::Io {
            dev: dev.clone(),
            source,
        };
        let mut poll = mio::Poll::new().map_err(io_err)?;
        let fd = self.tun.file.as_raw_fd();
        poll.registry()
            .register(&mut mio::unix::SourceFd(&fd), TUN, mio::Interest::READABLE)
            .map_err(io_err)?;
        poll.registry()
            .register(&mut self.sock, PORT, mio::Interest::READABLE)
            .map_err(io_err)?;
        let mut events = mio::Events::with_capacity(8);
        let mut buf = vec![0u8; 65536];
        while !stop.load(Ordering::Relaxed) {
            match poll.poll(&mut events, Some(Duration::from_millis(200))) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_err(e)),
            }
            // Edge-triggered: drain both sides whatever woke us.
            self.kernel_to_fabric(&mut buf).map_err(io_err)?;
            self.fabric_to_kernel(&mut buf).map_err(io_err)?;
        }
        tracing::info!(tun = %dev, "bridge stopping");
        Ok(())
    }

    /// Packets the kernel routed into the TUN device go onto the fabric.
    fn kernel_to_fabric(&mut self, buf: &mut [u8]) -> io::Result<()> {
        loop {
            let n = match self.tun.file.read(buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            let packet = &buf[..n];
            let route = match classify(&self.fabric, packet) {
                Outbound::Node { route, .. } => route,
                Outbound::Drop(why) => {
                    tracing::debug!(len = n, "from the kernel, dropped: {why}");
                    continue;
                }
            };
            tracing::trace!("kernel -> fabric: {}", summary(packet));
            let f = frame::encode(route, packet);
            let Ok((port, f)) = frame::switch(&f) else {
                continue; // invariant: a frame just built has a valid CRC and a route
            };
            let Some(dst) = self.routes.get(&port) else {
                tracing::debug!(port, "no node on switch port: dropped");
                continue;
            };
            if let Err(e) = self.sock.send_to(&f, *dst) {
                tracing::debug!(%dst, "frame dropped: {e}");
            }
        }
    }

    /// Frames for the bridge's switch port go to the kernel.
    fn fabric_to_kernel(&mut self, buf: &mut [u8]) -> io::Result<()> {
        loop {
            let n = match self.sock.recv_from(buf) {
                Ok((n, _)) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // ICMP port unreachable from an earlier send: not fatal.
                    tracing::trace!("bridge port: {e}");
                    return Ok(());
                }
            };
            match frame::decode(&buf[..n]) {
                Ok(packet) => {
                    tracing::trace!("fabric -> kernel: {}", summary(packet));
                    if let Err(e) = self.tun.file.write(packet) {
                        tracing::debug!("to the kernel, dropped: {e}");
                    }
                }
                Err(e) => tracing::debug!(len = n, "bad frame from the fabric: {e}"),
            }
        }
    }
}

fn set_nonblocking(tun: &Tun) -> Result<(), BridgeError> {
    let fd = tun.file.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own; results are checked.
    let ok = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) >= 0
    };
    if ok {
        Ok(())
    } else {
        Err(BridgeError::Io {
            dev: tun.name.clone(),
            source: io::Error::last_os_error(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packet(dst: Ipv6Addr) -> Vec<u8> {
        let mut p = vec![0u8; 48];
        p[0] = 0x60;
        p[24..40].copy_from_slice(&dst.octets());
        p
    }

    #[test]
    fn only_unicast_ipv6_to_nodes_crosses_the_bridge() {
        let f = FabricParams::default();
        let server: Ipv6Addr = "fd00:4c41:4e41::1".parse().unwrap();
        assert_eq!(
            classify(&f, &packet(server)),
            Outbound::Node {
                dst: server,
                route: &[1]
            }
        );
        let mld: Ipv6Addr = "ff02::16".parse().unwrap();
        assert_eq!(classify(&f, &packet(mld)), Outbound::Drop("multicast"));
        let other: Ipv6Addr = "fd00:4c41:4e41::99".parse().unwrap();
        assert!(matches!(classify(&f, &packet(other)), Outbound::Drop(_)));
        assert_eq!(classify(&f, &[0x45; 60]), Outbound::Drop("not IPv6"));
        assert_eq!(classify(&f, &[0x60; 10]), Outbound::Drop("not IPv6"));
    }

    #[test]
    fn bad_tun_names_are_refused() {
        assert!(matches!(Tun::create(""), Err(BridgeError::BadName(_))));
        assert!(matches!(
            Tun::create("a-name-far-too-long"),
            Err(BridgeError::BadName(_))
        ));
    }
}
