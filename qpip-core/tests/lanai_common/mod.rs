//! A private fabric per test: unique UDP ports, a unique /64 and a unique TUN name, written
//! to its own TOML file, so lanai tests (in this crate and, through `#[path]`, in nbd-client)
//! run in parallel without meeting. Shared by qpip-core's and nbd-client's lanai tests.
#![allow(dead_code)]

use std::net::{Ipv6Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU16, Ordering};

use qpip_core::lanai::{FabricParams, LanaiConfig, LanaiParams};

pub(crate) struct TestFabric {
    /// The fabric config file (deleted on drop).
    pub path: PathBuf,
    pub params: FabricParams,
    /// The kernel's address on the bridge's TUN device.
    pub host_addr: Ipv6Addr,
    pub tun: String,
}

impl Drop for TestFabric {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl TestFabric {
    pub(crate) fn addr(&self, node: &str) -> Ipv6Addr {
        self.params
            .node(node)
            .expect("node in the test fabric")
            .addr
    }

    /// A lanai NIC configuration for `node` of this fabric.
    pub(crate) fn config(&self, node: &str) -> LanaiConfig {
        LanaiConfig {
            params: LanaiParams::default(),
            fabric: self.params.clone(),
            node: Some(node.into()),
        }
    }
}

fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map(|a| a.port())
        .expect("a free UDP port")
}

/// Nodes "server", "client" and "client2" (routes 1, 2, 3) and a bridge (route 0).
pub(crate) fn test_fabric() -> TestFabric {
    static N: AtomicU16 = AtomicU16::new(1);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let pid = std::process::id();
    // fd00:<pid>:<n>::/64 and qpt<pid>n<n> — unique per process and test.
    let prefix = format!("fd00:{:x}:{:x}:{n:x}", pid >> 16, pid & 0xffff);
    let tun = format!("qpt{pid:x}n{n:x}");
    let mut toml =
        String::from("link_gbps = 2.0\nswitch_latency_ns = 300\ncable_ns = 25\nmtu = 16384\n");
    for (i, name) in ["server", "client", "client2"].iter().enumerate() {
        toml += &format!(
            "\n[[node]]\nname = \"{name}\"\naddr = \"{prefix}::{}\"\nroute = [{}]\nport = \"127.0.0.1:{}\"\n",
            i + 1,
            i + 1,
            free_udp_port()
        );
    }
    toml += &format!(
        "\n[bridge]\nname = \"bridge\"\nroute = [0]\nport = \"127.0.0.1:{}\"\ntun = \"{tun}\"\nhost_addr = \"{prefix}::fe\"\nprefix_len = 64\n",
        free_udp_port()
    );
    let path = std::env::temp_dir().join(format!("qpip-lanai-fabric-{pid}-{n}.toml"));
    std::fs::write(&path, &toml).expect("writing the test fabric");
    let params = FabricParams::load(&path).expect("the test fabric parses");
    let host_addr = params.bridge.as_ref().expect("bridge").host_addr;
    TestFabric {
        path,
        params,
        host_addr,
        tun,
    }
}

/// A socket address of `node` on this fabric.
pub(crate) fn sock(fabric: &TestFabric, node: &str, port: u16) -> SocketAddr {
    SocketAddr::from((fabric.addr(node), port))
}

/// Root-only prerequisites (TUN, `ip`): in CI their absence is a failure, elsewhere a skip.
pub(crate) fn can_bridge() -> bool {
    // SAFETY: plain syscall.
    let root = unsafe { libc::geteuid() } == 0;
    let tun = std::path::Path::new("/dev/net/tun").exists();
    let ip = ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"]
        .iter()
        .any(|p| std::path::Path::new(p).is_file());
    let ok = root && tun && ip;
    ok || qpip_test_support::ci::missing(&format!(
        "what the bridge test needs: root ({root}), /dev/net/tun ({tun}) and ip ({ip})"
    ))
}
