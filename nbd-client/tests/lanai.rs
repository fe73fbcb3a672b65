//! NBD over the lanai backend: qpip-nbd-server on one node of a private emulated fabric,
//! the client library and `qpip-nbd` on others; as root, the host kernel's TCP (qemu-io,
//! nbdinfo) reaching the server through qpip-lanai-bridge.

mod common;
#[path = "../../qpip-core/tests/lanai_common/mod.rs"]
mod lanai_common;

use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use common::{have, pattern, qpip_server_bin, workspace_bin};
use lanai_common::*;
use nbd_client::{Client, ClientOptions};
use qpip_core::{Nic, NicChoice};

const IMAGE: u64 = 64 << 20;

/// A child process killed (SIGTERM first, so the bridge removes its TUN) when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        // SAFETY: plain syscall on the child this test started.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGTERM) };
        for _ in 0..50 {
            if self.0.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spawns `cmd` and waits for a stderr line (status lines go there, with the log) starting
/// with `prefix`; returns its rest. Keeps draining stderr afterwards.
fn spawn_until(mut cmd: Command, prefix: &str) -> (Proc, String) {
    let mut child = cmd
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    let mut out = BufReader::new(child.stderr.take().unwrap());
    let proc = Proc(child);
    let mut line = String::new();
    let rest = loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "{cmd:?} exited before printing {prefix:?}"
        );
        if let Some(r) = line.trim().strip_prefix(prefix) {
            break r.to_string();
        }
    };
    std::thread::spawn(move || {
        let mut s = String::new();
        while out.read_line(&mut s).is_ok_and(|n| n > 0) {
            s.clear();
        }
    });
    (proc, rest)
}

/// qpip-nbd-server --backend lanai on node "server" of `fabric`, exporting `disk` = `image`.
fn lanai_server(fabric: &TestFabric, image: &Path) -> (Proc, String) {
    let mut cmd = Command::new(qpip_server_bin());
    cmd.args(["--backend", "lanai", "--lanai-fabric"])
        .arg(&fabric.path)
        .arg("--export")
        .arg(format!("disk={}", image.display()))
        .args(["--log", "warn"]);
    let (proc, addr) = spawn_until(cmd, "qpip-nbd-server: listening on ");
    // The default listen address is the node's fabric address.
    assert_eq!(addr, format!("[{}]:10809", fabric.addr("server")));
    (proc, format!("nbd://{addr}/disk"))
}

fn bridge_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| workspace_bin("qpip-cli", "qpip-lanai-bridge"))
        .clone()
}

fn sparse_image(dir: &Path) -> PathBuf {
    let path = dir.join("disk.img");
    std::fs::File::create(&path)
        .unwrap()
        .set_len(IMAGE)
        .unwrap();
    path
}

/// The client library on a lanai NIC (node "client"): pattern writes at odd offsets and
/// sizes (up to several MiB, crossing the 1 MiB request limit), reads back, flush, trim —
/// checked against the image file the server writes.
#[test]
fn client_library_over_lanai_reads_writes_flushes_trims() {
    let fabric = test_fabric();
    let dir = tempfile::tempdir().unwrap();
    let image = sparse_image(dir.path());
    let (_server, uri) = lanai_server(&fabric, &image);
    let nic = Nic::open(NicChoice::Lanai(fabric.config("client"))).unwrap();
    let mut c = Client::connect_with(
        &uri,
        ClientOptions {
            nic: Some(nic),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(c.size(), IMAGE);
    let ranges: [(u64, usize); 5] = [
        (0, 4096),
        (512, 1),
        (1 << 20, 3 << 20),
        (IMAGE - 70_000, 70_000),
        (33 << 20, 123_457),
    ];
    for &(off, len) in &ranges {
        c.write_at(off, &pattern(off, len), false).unwrap();
    }
    c.flush().unwrap();
    let file = std::fs::File::open(&image).unwrap();
    for &(off, len) in &ranges {
        let mut got = vec![0u8; len];
        c.read_at(off, &mut got).unwrap();
        assert!(got == pattern(off, len), "read back {off}+{len}");
        let mut disk = vec![0u8; len];
        file.read_exact_at(&mut disk, off).unwrap();
        // The 512+1 write landed inside the first 4 KiB one.
        if off != 0 {
            assert!(disk == pattern(off, len), "image at {off}+{len}");
        }
    }
    if c.can_trim() {
        c.trim(1 << 20, 1 << 20).unwrap();
        c.flush().unwrap();
        let mut got = vec![1u8; 1 << 20];
        c.read_at(1 << 20, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == 0), "trimmed range reads as zeroes");
    }
    c.disconnect().unwrap();
}

/// `qpip-nbd info --backend lanai` on node "client2" reports the export.
#[test]
fn qpip_nbd_info_over_lanai() {
    let fabric = test_fabric();
    let dir = tempfile::tempdir().unwrap();
    let image = sparse_image(dir.path());
    let (_server, uri) = lanai_server(&fabric, &image);
    let out = Command::new(env!("CARGO_BIN_EXE_qpip-nbd"))
        .args([
            "info",
            "--json",
            "--backend",
            "lanai",
            "--lanai-node",
            "client2",
        ])
        .arg("--lanai-fabric")
        .arg(&fabric.path)
        .arg(&uri)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "qpip-nbd info failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v["exports"][0]["export-size"], IMAGE, "{stdout}");

    // An IPv4 URI is refused with a reason.
    let out = Command::new(env!("CARGO_BIN_EXE_qpip-nbd"))
        .args(["info", "--backend", "lanai", "--lanai-node", "client2"])
        .arg("--lanai-fabric")
        .arg(&fabric.path)
        .arg("nbd://127.0.0.1:10809/disk")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("IPv6 only"), "{stderr}");
}

/// As root: the kernel's own TCP — qemu-io and nbdinfo — reaches the firmware's QPs
/// through qpip-lanai-bridge.
#[test]
fn qemu_io_over_the_bridge() {
    if !can_bridge() || !have("qemu-io") {
        return;
    }
    let fabric = test_fabric();
    let dir = tempfile::tempdir().unwrap();
    let image = sparse_image(dir.path());
    let mut cmd = Command::new(bridge_bin());
    cmd.arg("--fabric")
        .arg(&fabric.path)
        .args(["--log", "warn"]);
    let (_bridge, up) = spawn_until(cmd, "qpip-lanai-bridge: ");
    assert_eq!(up, format!("{} up", fabric.tun));
    let (_server, uri) = lanai_server(&fabric, &image);

    let mut args = Vec::new();
    for (pat, off, len) in [
        ("0xab", 0u64, "1M"),
        ("0x5a", 4096 * 1000 + 512, "64k"),
        ("0x11", IMAGE - 8192, "8k"),
    ] {
        args.push(format!("write -P {pat} {off} {len}"));
        args.push(format!("read -P {pat} {off} {len}"));
    }
    args.push("flush".into());
    args.push("read -P 0xab 0 4k".into());
    let mut cmd = Command::new("qemu-io");
    cmd.args(["-f", "raw"]);
    for a in &args {
        cmd.args(["-c", a]);
    }
    let out = cmd.arg(&uri).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "qemu-io: {stdout}\n{stderr}");
    assert!(!stdout.contains("Pattern verification failed"), "{stdout}");
    assert_eq!(stdout.matches("read ").count(), 4, "{stdout}");
    let file = std::fs::File::open(&image).unwrap();
    let mut got = vec![0u8; 1 << 20];
    file.read_exact_at(&mut got, 0).unwrap();
    assert!(
        got.iter().all(|&b| b == 0xab),
        "image holds qemu-io's write"
    );

    if have("nbdinfo") {
        let out = Command::new("nbdinfo")
            .arg("--size")
            .arg(&uri)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "nbdinfo: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            IMAGE.to_string()
        );
    }
}
