//! Exports backed by Ceph RBD, against a real cluster: the single-node one scripts/ceph-dev
//! starts (scripts/test does, where the rbd feature is on). Each test makes its own image and
//! removes it. Skipped, with a note, when the server is built without the rbd feature or no
//! cluster runs (a missing cluster fails the test in CI when the feature is on).
//!
//! The tests take turns (a lock here, and nextest's "ceph" test group): one of them stops
//! the OSD for a while, and one kills it and starts it again.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::*;

const MIB: u64 = 1 << 20;

static TURNS: Mutex<()> = Mutex::new(());

/// The dev cluster, as scripts/ceph-dev env describes it.
struct Ceph {
    conf: PathBuf,
    pool: String,
}

impl Ceph {
    fn get() -> Option<Ceph> {
        if !cfg!(feature = "rbd") {
            eprintln!(
                "note: skipping this test: nbd-server is built without the rbd feature (scripts/test turns it on where librbd-dev is installed: cargo nextest run -p nbd-server --features rbd)"
            );
            return None;
        }
        let conf = PathBuf::from(
            std::env::var("QPIP_CEPH_CONF").unwrap_or_else(|_| "/tmp/qpip-ceph/ceph.conf".into()),
        );
        if !conf.is_file() {
            let msg = format!(
                "a Ceph cluster (the rbd feature is on, but {} does not exist: start one with \
                 scripts/ceph-dev)",
                conf.display()
            );
            missing(&msg);
            return None;
        }
        if !require(&["rbd", "qemu-io", "qemu-img", "nbdinfo", "nbdcopy", "fio"]) {
            return None;
        }
        Some(Ceph {
            conf,
            pool: std::env::var("QPIP_CEPH_POOL").unwrap_or_else(|_| "rbd".into()),
        })
    }

    fn rbd(&self) -> Command {
        let mut c = Command::new("rbd");
        c.arg("-c").arg(&self.conf);
        c
    }

    /// A fresh image of `size` bytes, removed when dropped.
    fn image(&self, tag: &str, size: u64) -> TestImage<'_> {
        // The process id alone repeats in a long-lived dev cluster, where images of killed
        // servers are kept (a dead server's watch blocks their removal for a while).
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!("qpip-test-{tag}-{}-{nonce:x}", std::process::id());
        let _ = run_with_timeout(
            self.rbd().args(["rm", "--no-progress", &self.spec(&name)]),
            Duration::from_secs(60),
        );
        peer_ok(self.rbd().args([
            "create",
            &self.spec(&name),
            "--size",
            &format!("{}M", size / MIB),
        ]));
        TestImage {
            ceph: self,
            name,
            keep: false,
        }
    }

    fn spec(&self, image: &str) -> String {
        format!("{}/{image}", self.pool)
    }

    /// Server arguments for the cluster, with the export NAME=rbd:POOL/IMAGE[@SNAP].
    fn server_args(&self, exports: &[(&str, &str)]) -> Vec<String> {
        let mut a = vec!["--ceph-conf".to_string(), self.conf.display().to_string()];
        for (name, what) in exports {
            a.push("--export".into());
            a.push(format!("{name}=rbd:{}/{what}", self.pool));
        }
        a
    }

    /// The image as `rbd export` writes it.
    fn export(&self, image: &str, dir: &Path) -> Vec<u8> {
        let out = dir.join(format!("{image}.exported"));
        let _ = std::fs::remove_file(&out);
        peer_ok(
            self.rbd()
                .args(["export", "--no-progress", &self.spec(image)])
                .arg(&out),
        );
        std::fs::read(&out).unwrap()
    }

    /// The OSD's pid (scripts/ceph-dev keeps the daemons' pid files next to ceph.conf).
    fn osd_pid(&self) -> i32 {
        let f = self.conf.parent().unwrap().join("run/osd.0.pid");
        std::fs::read_to_string(&f)
            .unwrap_or_else(|e| panic!("{}: {e}", f.display()))
            .trim()
            .parse()
            .unwrap()
    }
}

struct TestImage<'a> {
    ceph: &'a Ceph,
    name: String,
    /// Left in the pool: a killed server's watch on it lingers for 30 s, during which
    /// `rbd rm` waits to break its lock. The dev cluster is a scratch one.
    keep: bool,
}

/// Waits (up to a minute) until qemu-io's `cmds` on `uri` all pass: `what` serves again after
/// the cluster came back.
fn serves_again(uri: &str, cmds: &[&str], what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut c = Command::new("qemu-io");
        c.args(["-f", "raw"]);
        for cmd in cmds {
            c.args(["-c", cmd]);
        }
        let out = run_with_timeout(c.arg(uri), Duration::from_secs(60));
        if out.status.success() && !text(&out).contains("error") {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what} did not come back:\n{}",
            text(&out)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Stops a server as SIGTERM does, which closes its RBD images (and their watches).
fn stop(mut srv: ServerProcess) {
    srv.signal(libc::SIGTERM);
    assert!(
        srv.wait_timeout(Duration::from_secs(20)).is_some(),
        "the server did not exit on SIGTERM:\n{}",
        srv.log()
    );
}

impl Drop for TestImage<'_> {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        let _ = run_with_timeout(
            self.ceph
                .rbd()
                .args(["rm", "--no-progress", &self.ceph.spec(&self.name)]),
            Duration::from_secs(60),
        );
    }
}

fn nbdcopy_to(uri: &str, out: &Path) -> Vec<u8> {
    peer_ok(Command::new("nbdcopy").arg(uri).arg(out));
    std::fs::read(out).unwrap()
}

#[test]
fn rbd_export_serves_qemu_img_qemu_io_nbdinfo_nbdcopy_and_fio() {
    let _turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ceph) = Ceph::get() else { return };
    let dir = tempfile::tempdir().unwrap();
    let img = ceph.image("clients", 64 * MIB);
    let srv = start_server_v4(&ceph.server_args(&[("disk", &img.name)]));
    let uri = srv.uri("disk");
    assert!(
        srv.log().contains(&format!(
            "rbd:{}/{} (rbd, {} bytes)",
            ceph.pool,
            img.name,
            64 * MIB
        )),
        "{}",
        srv.log()
    );

    let info = peer_ok(Command::new("qemu-img").args(["info", "-f", "raw", &uri]));
    assert!(info.contains("virtual size: 64 MiB"), "{info}");
    let info = peer_ok(Command::new("nbdinfo").arg(&uri));
    for want in [
        "export-size: 67108864",
        "can_trim: true",
        "can_zero: true",
        "is_read_only: false",
    ] {
        assert!(info.contains(want), "nbdinfo lacks {want:?}:\n{info}");
    }

    qemu_io(
        &uri,
        &[
            "write -P 0xa5 0 3M",
            "write -P 0x5a 5M 64k",
            "write -z 1M 512k",
            "flush",
            "read -P 0xa5 0 1M",
            "read -P 0 1M 512k",
            "read -P 0xa5 1536k 1536k",
            "read -P 0x5a 5M 64k",
        ],
    );
    // Block status from librbd's allocation: the far end was never written.
    let map = peer_ok(Command::new("nbdinfo").args(["--map", &uri]));
    let last = map.lines().last().unwrap_or_default().to_string();
    assert!(
        last.contains("hole"),
        "the image's tail is not a hole:\n{map}"
    );
    assert!(
        map.lines().next().unwrap_or_default().contains("data"),
        "{map}"
    );

    let copied = nbdcopy_to(&uri, &dir.path().join("copy"));
    let exported = ceph.export(&img.name, dir.path());
    assert_eq!(copied.len(), exported.len());
    assert!(
        copied == exported,
        "nbdcopy of the export differs from rbd export"
    );

    let out = peer_ok(Command::new("fio").args([
        "--name=qpip-rbd",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        "--rw=randwrite",
        "--bsrange=4k-256k",
        "--size=16M",
        "--iodepth=8",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--randseed=4321",
        "--verify_state_save=0",
    ]));
    assert!(out.contains("err= 0"), "fio reported an error:\n{out}");
    for bad in ["verify failed", "bad magic", "mismatch"] {
        assert!(!out.contains(bad), "fio verify complaint {bad:?}:\n{out}");
    }
    qemu_io(&uri, &["flush"]);
    let copied = nbdcopy_to(&uri, &dir.path().join("copy2"));
    let exported = ceph.export(&img.name, dir.path());
    assert!(
        copied == exported,
        "after fio: nbdcopy differs from rbd export"
    );
    stop(srv);
}

#[test]
fn rbd_flushed_writes_survive_kill_9() {
    let _turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ceph) = Ceph::get() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut img = ceph.image("kill9", 32 * MIB);
    img.keep = true;
    let mut srv = start_server_v4(&ceph.server_args(&[("disk", &img.name)]));
    qemu_io(
        &srv.uri("disk"),
        &[
            "write -P 0xc3 0 4M",
            "write -P 0x3c 8M 1M",
            "write -f -P 0x5a 20M 64k",
            "flush",
        ],
    );
    srv.kill9();
    assert!(!srv.alive());
    let disk = ceph.export(&img.name, dir.path());
    assert_eq!(disk.len() as u64, 32 * MIB);
    assert!(disk[..4 << 20].iter().all(|&b| b == 0xc3));
    assert!(disk[4 << 20..8 << 20].iter().all(|&b| b == 0));
    assert!(disk[8 << 20..9 << 20].iter().all(|&b| b == 0x3c));
    assert!(
        disk[20 << 20..(20 << 20) + (64 << 10)]
            .iter()
            .all(|&b| b == 0x5a)
    );
}

#[test]
fn rbd_snapshot_export_is_read_only_and_frozen() {
    let _turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ceph) = Ceph::get() else { return };
    let img = ceph.image("snap", 16 * MIB);
    let srv = start_server_v4(&ceph.server_args(&[("disk", &img.name)]));
    qemu_io(&srv.uri("disk"), &["write -P 0x11 0 1M", "flush"]);
    stop(srv);
    peer_ok(
        ceph.rbd()
            .args(["snap", "create", &format!("{}@s1", ceph.spec(&img.name))]),
    );
    let snap = format!("{}@s1", img.name);
    let srv = start_server_v4(&ceph.server_args(&[("live", &img.name), ("frozen", &snap)]));
    qemu_io(&srv.uri("live"), &["write -P 0x22 0 1M", "flush"]);
    peer_ok(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-r",
        "-c",
        "read -P 0x11 0 1M",
        &srv.uri("frozen"),
    ]));
    qemu_io(&srv.uri("live"), &["read -P 0x22 0 1M"]);
    let info = peer_ok(Command::new("nbdinfo").arg(srv.uri("frozen")));
    assert!(info.contains("is_read_only: true"), "{info}");
    let out = run_with_timeout(
        Command::new("qemu-io").args(["-f", "raw", "-c", "write 0 4k", &srv.uri("frozen")]),
        Duration::from_secs(60),
    );
    assert!(
        !out.status.success() || text(&out).contains("failed"),
        "a write to the snapshot export succeeded:\n{}",
        text(&out)
    );
    stop(srv);
    let _ = run_with_timeout(
        ceph.rbd()
            .args(["snap", "purge", "--no-progress", &ceph.spec(&img.name)]),
        Duration::from_secs(60),
    );
}

/// The server refuses to start, with one line on stderr that contains `want`.
fn fails_with(args: &[String], want: &str) {
    let out = run_with_timeout(
        Command::new(BIN)
            .args(["--listen", "127.0.0.1:0", "--ceph-timeout", "3"])
            .args(args),
        Duration::from_secs(30),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.contains(" INFO ")).collect();
    assert!(!out.status.success(), "started with {args:?}:\n{err}");
    assert_eq!(lines.len(), 1, "not one line of error for {args:?}:\n{err}");
    assert!(
        lines[0].contains(want),
        "{args:?}: wanted {want:?} in:\n{err}"
    );
}

#[test]
fn rbd_missing_cluster_pool_image_and_permission_are_one_line_errors() {
    let _turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ceph) = Ceph::get() else { return };
    let dir = tempfile::tempdir().unwrap();
    let img = ceph.image("errors", 4 * MIB);
    let conf = ceph.conf.display().to_string();
    let with = |export: &str, extra: &[&str]| {
        let mut a = vec![
            "--ceph-conf".to_string(),
            conf.clone(),
            "--export".into(),
            export.into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    fails_with(
        &with("d=rbd:no-such-pool/x", &[]),
        "Ceph pool \"no-such-pool\" does not exist",
    );
    fails_with(
        &with(&format!("d=rbd:{}/no-such-image", ceph.pool), &[]),
        &format!("RBD image {}/no-such-image does not exist", ceph.pool),
    );
    fails_with(&with("d=rbd:just-a-name", &[]), "no pool");
    // A cluster nobody runs: the monitor's address moved to a port where none listens.
    let text = std::fs::read_to_string(&ceph.conf).unwrap();
    let dead = dir.path().join("dead.conf");
    let moved: String = text
        .lines()
        .map(|l| {
            if l.starts_with("mon_host") {
                "mon_host = v2:127.0.0.1:1".to_string()
            } else {
                l.to_string()
            }
        })
        .map(|l| l + "\n")
        .collect();
    std::fs::write(&dead, moved).unwrap();
    let t = Instant::now();
    fails_with(
        &[
            "--ceph-conf".into(),
            dead.display().to_string(),
            "--export".into(),
            format!("d=rbd:{}/{}", ceph.pool, img.name),
        ],
        "cannot reach the Ceph cluster",
    );
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    fails_with(
        &with(
            &format!("d=rbd:{}/{}", ceph.pool, img.name),
            &["--ceph-id", "nobody"],
        ),
        "no keyring",
    );
    // A client whose caps do not cover the pool.
    let keyring = dir.path().join("ceph.client.qpip-lim.keyring");
    peer_ok(
        Command::new("ceph")
            .arg("-c")
            .arg(&ceph.conf)
            .args([
                "auth",
                "get-or-create",
                "client.qpip-lim",
                "mon",
                "allow r",
                "osd",
                "allow rwx pool=elsewhere",
                "-o",
            ])
            .arg(&keyring),
    );
    fails_with(
        &with(
            &format!("d=rbd:{}/{}", ceph.pool, img.name),
            &[
                "--ceph-id",
                "qpip-lim",
                "--ceph-keyring",
                &keyring.display().to_string(),
            ],
        ),
        "client.qpip-lim may not open RBD image",
    );
}

/// Sends SIGCONT to the OSD when dropped, so that a failing test leaves the cluster running.
struct Stopped(i32);

impl Drop for Stopped {
    fn drop(&mut self) {
        // SAFETY: plain kill(2).
        unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
}

#[test]
fn rbd_cluster_gone_mid_run_fails_requests_with_eio_while_other_exports_serve() {
    let _turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ceph) = Ceph::get() else { return };
    let dir = tempfile::tempdir().unwrap();
    let img = ceph.image("gone", 16 * MIB);
    let file = image(dir.path(), "file.img", 16 * MIB);
    let mut args = ceph.server_args(&[("disk", &img.name)]);
    args.extend(["--ceph-timeout".into(), "3".into(), "--export".into()]);
    args.push(format!("file={}", file.display()));
    let mut srv = start_server_v4(&args);
    qemu_io(
        &srv.uri("disk"),
        &["write -P 0x77 0 1M", "write -P 0x66 8M 64k", "flush"],
    );

    let osd = ceph.osd_pid();
    // SAFETY: plain kill(2) on the dev cluster's OSD, continued by the guard.
    assert_eq!(unsafe { libc::kill(osd, libc::SIGSTOP) }, 0);
    let stopped = Stopped(osd);
    let t = Instant::now();
    // Written data (an unwritten range reads as zeroes from librbd's object map alone, and
    // librbd's default cache policy does not keep reads): the OSD does not answer. -r: no
    // flush at the end.
    let out = run_with_timeout(
        Command::new("qemu-io").args(["-f", "raw", "-r", "-c", "read 8M 64k", &srv.uri("disk")]),
        Duration::from_secs(60),
    );
    let said = text(&out);
    assert!(said.contains("Input/output error"), "{said}");
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    // The other export serves meanwhile, and the server lives.
    qemu_io(
        &srv.uri("file"),
        &["write -P 0x42 0 1M", "flush", "read -P 0x42 0 1M"],
    );
    srv.assert_alive("after the cluster went away");
    assert!(
        srv.log().contains("ETIMEDOUT") || srv.log().contains("timed out"),
        "{}",
        srv.log()
    );
    drop(stopped);

    // Back: the export serves again.
    serves_again(
        &srv.uri("disk"),
        &["read -P 0x77 0 1M", "read -P 0x66 8M 64k"],
        "the export",
    );
    stop(srv);
}

/// The client that holds the image's exclusive lock, as `rbd status` names its watcher
/// (`client.N`).
fn watchers(ceph: &Ceph, image: &str) -> Vec<String> {
    let out = peer_ok(ceph.rbd().args(["status", &ceph.spec(image)]));
    out.split_whitespace()
        .filter(|w| w.starts_with("client."))
        .map(str::to_owned)
        .collect()
}

#[test]
fn rbd_exclusive_refuses_a_second_server_naming_the_holder() {
    let _turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ceph) = Ceph::get() else { return };
    let img = ceph.image("excl", 16 * MIB);
    let mut args = ceph.server_args(&[("disk", &img.name)]);
    args.push("--exclusive".into());
    let mut srv = start_server_v4(&args);
    qemu_io(
        &srv.uri("disk"),
        &["write -P 0x31 0 1M", "flush", "read -P 0x31 0 1M"],
    );
    let holder = watchers(&ceph, &img.name);
    assert_eq!(holder.len(), 1, "{holder:?}");
    fails_with(&args, &format!("is locked exclusively by {} ", holder[0]));
    // The first one serves on, and still alone.
    qemu_io(&srv.uri("disk"), &["read -P 0x31 0 1M"]);
    srv.assert_alive("after a second server was refused");
    stop(srv);
    // Released at exit: the next one takes it.
    let srv = start_server_v4(&args);
    qemu_io(&srv.uri("disk"), &["read -P 0x31 0 1M"]);
    stop(srv);
}

/// Waits until a new connection is told `size` (the server learns a resize through its
/// watch on the image, a moment after `rbd resize` returns).
fn wait_for_size(uri: &str, size: u64) {
    let told = |info: &str| {
        info.lines().any(|l| {
            l.split_whitespace()
                .take(2)
                .eq(["export-size:", &size.to_string()])
        })
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let info = peer_ok(Command::new("nbdinfo").arg(uri));
        if told(&info) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "new connections are not told {size} bytes:\n{info}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn rbd_resize_grow_and_shrink_while_serving() {
    use nbd::client::{NbdClient, handshake};
    use std::io::{Read, Seek, SeekFrom, Write};

    let _turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ceph) = Ceph::get() else { return };
    let img = ceph.image("resize", 32 * MIB);
    let mut srv = start_server_v4(&ceph.server_args(&[("disk", &img.name)]));
    let uri = srv.uri("disk");
    qemu_io(
        &uri,
        &["write -P 0x11 0 1M", "write -P 0x44 24M 1M", "flush"],
    );
    // A connection open across both resizes, told 32 MiB.
    let mut tcp = std::net::TcpStream::connect(srv.addr).unwrap();
    let export = handshake(&mut tcp, b"disk").unwrap();
    assert_eq!(export.size, 32 * MIB);
    let mut old = NbdClient::new(tcp, &export);
    let read = |c: &mut NbdClient<std::net::TcpStream>, at: u64| {
        c.seek(SeekFrom::Start(at)).unwrap();
        let mut b = vec![0u8; MIB as usize];
        c.read_exact(&mut b).map(|()| b)
    };

    // Grow: new connections see 64 MiB and use all of it.
    rbd_resize(&ceph, &img.name, "64M", false);
    serves_64m(&uri, 0x55, "read -P 0x44 24M 1M");
    // The old connection keeps its 32 MiB.
    assert!(read(&mut old, 24 * MIB).unwrap().iter().all(|&b| b == 0x44));
    assert!(
        srv.log()
            .contains("resized from 33554432 to 67108864 bytes"),
        "{}",
        srv.log()
    );

    // Shrink below what the old connection was told.
    rbd_resize(&ceph, &img.name, "16M", true);
    wait_for_size(&uri, 16 * MIB);
    let length = qemu_io(&uri, &["length"]);
    assert!(length.contains("16 MiB"), "{length}");
    qemu_io(&uri, &["read -P 0x11 0 1M"]);
    read_past_16m_fails(&uri);
    // The old connection: past the new end, EINVAL for a read and ENOSPC for a write; within
    // it, served as before, on the same connection.
    let e = read(&mut old, 24 * MIB).unwrap_err();
    assert!(e.to_string().contains("EINVAL"), "{e}");
    old.seek(SeekFrom::Start(20 * MIB)).unwrap();
    let e = old.write_all(&[0x66; 4096]).unwrap_err();
    assert!(e.to_string().contains("ENOSPC"), "{e}");
    assert!(read(&mut old, 0).unwrap().iter().all(|&b| b == 0x11));
    old.seek(SeekFrom::Start(MIB)).unwrap();
    old.write_all(&[0x77; 4096]).unwrap();
    old.flush().unwrap();
    drop(old);
    srv.assert_alive("after the resizes");
    qemu_io(&uri, &["read -P 0x77 1M 4k"]);
    stop(srv);
}

#[test]
fn rbd_luks2_image_is_served_decrypted_with_its_passphrase() {
    let _turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ceph) = Ceph::get() else { return };
    let dir = tempfile::tempdir().unwrap();
    let img = ceph.image("luks", 32 * MIB);
    let pass = dir.path().join("pass");
    std::fs::write(&pass, "qpip test passphrase").unwrap();
    let wrong = dir.path().join("wrong");
    std::fs::write(&wrong, "not the passphrase").unwrap();
    peer_ok(
        ceph.rbd()
            .args(["encryption", "format", &ceph.spec(&img.name), "luks2"])
            .arg(&pass),
    );
    let with = |format: &str, file: &str| {
        let mut a = ceph.server_args(&[("disk", &img.name)]);
        a.extend(["--encryption-format".into(), format.into()]);
        a.extend(["--encryption-passphrase-file".into(), file.into()]);
        a
    };
    // Per export: NAME=VALUE.
    let srv = start_server_v4(&with("disk=luks2", &format!("disk={}", pass.display())));
    let uri = srv.uri("disk");
    // The disk inside: the image less librbd's 16 MiB LUKS2 header.
    let length = qemu_io(&uri, &["length"]);
    assert!(length.contains("16 MiB"), "{length}");
    qemu_io(
        &uri,
        &["write -P 0xe7 0 1M", "write -P 0x3d 5M 512k", "flush"],
    );
    stop(srv);
    // A fresh server, rbd-nbd's spelling (for every rbd: export), reads it back.
    let srv = start_server_v4(&with("luks2", &pass.display().to_string()));
    qemu_io(
        &srv.uri("disk"),
        &[
            "read -P 0xe7 0 1M",
            "read -P 0x3d 5M 512k",
            "read -P 0 2M 1M",
        ],
    );
    stop(srv);
    // The cluster holds ciphertext: no sector of either pattern, and data where they went.
    let raw = ceph.export(&img.name, dir.path());
    for p in [0xe7u8, 0x3d] {
        assert!(
            !raw.chunks(512).any(|c| c.iter().all(|&b| b == p)),
            "rbd export shows the pattern {p:#x} in clear"
        );
    }
    assert!(raw[16 << 20..17 << 20].iter().any(|&b| b != 0));
    // A wrong passphrase: one line at start.
    fails_with(
        &with("luks2", &wrong.display().to_string()),
        "does not open its luks2 encryption (a wrong passphrase",
    );
    fails_with(
        &with("luks1", &pass.display().to_string()),
        "is not encrypted as luks1",
    );
}

/// Deep queues: fio keeps 32 requests in flight on each of two connections, with a FLUSH
/// every 8 writes; every block verifies, and after a last FLUSH and kill -9 the cluster holds
/// what the server served.
#[test]
fn rbd_deep_queues_verify_and_flushed_writes_reach_the_cluster() {
    let _turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ceph) = Ceph::get() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut img = ceph.image("deep", 64 * MIB);
    img.keep = true;
    let mut srv = start_server_v4(&ceph.server_args(&[("disk", &img.name)]));
    let uri = srv.uri("disk");
    let out = peer_ok(Command::new("fio").args([
        "--name=qpip-rbd-deep",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        "--rw=randwrite",
        "--bsrange=4k-1m",
        "--size=24M",
        "--numjobs=2",
        "--offset_increment=32M",
        "--iodepth=32",
        "--iodepth_batch_submit=8",
        "--fsync=8",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        "--randseed=777",
        "--verify_state_save=0",
        "--group_reporting",
    ]));
    assert!(out.contains("err= 0"), "fio reported an error:\n{out}");
    for bad in ["verify failed", "bad magic", "mismatch"] {
        assert!(!out.contains(bad), "fio verify complaint {bad:?}:\n{out}");
    }
    qemu_io(&uri, &["write -P 0x5e 63M 1M", "flush"]);
    let served = nbdcopy_to(&uri, &dir.path().join("served"));
    srv.kill9();
    let exported = ceph.export(&img.name, dir.path());
    assert!(
        served == exported,
        "rbd export differs from what the server served"
    );
    assert!(exported[63 << 20..].iter().all(|&b| b == 0x5e));
}

/// Starts the dev cluster's OSD again if it is not running (scripts/ceph-dev starts it so;
/// it daemonizes and writes its pid file), and waits until the cluster has it up.
fn start_osd(ceph: &Ceph) {
    // SAFETY: signal 0 sends nothing; kill only checks that the process exists.
    let alive = |pid: i32| unsafe { libc::kill(pid, 0) } == 0;
    let pidfile = ceph.conf.parent().unwrap().join("run/osd.0.pid");
    let running = std::fs::read_to_string(&pidfile)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .is_some_and(alive);
    if !running {
        peer_ok(
            Command::new("ceph-osd")
                .arg("-c")
                .arg(&ceph.conf)
                .args(["-i", "0"]),
        );
    }
}

/// Starts the OSD again when dropped, so that a failing test leaves the cluster running.
struct Killed<'a>(&'a Ceph);

impl Drop for Killed<'_> {
    fn drop(&mut self) {
        start_osd(self.0);
    }
}

#[test]
fn rbd_osd_killed_and_restarted_mid_write_loses_no_flushed_write() {
    use nbd::client::{NbdClient, handshake};
    use std::io::{Seek, SeekFrom, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};

    let _turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ceph) = Ceph::get() else { return };
    let began = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let mut img = ceph.image("osdkill", 64 * MIB);
    img.keep = true;
    let file = image(dir.path(), "file.img", 16 * MIB);
    let mut args = ceph.server_args(&[("disk", &img.name)]);
    args.extend(["--ceph-timeout".into(), "60".into(), "--export".into()]);
    args.push(format!("file={}", file.display()));
    let mut srv = start_server_v4(&args);
    eprintln!("{:?}: server started", began.elapsed());
    // Another server whose requests may take 3 s: they fail with EIO while the OSD is down.
    let img2 = ceph.image("osdkill-eio", 16 * MIB);
    let mut args2 = ceph.server_args(&[("quick", &img2.name)]);
    args2.extend(["--ceph-timeout".into(), "3".into()]);
    let mut quick = start_server_v4(&args2);
    qemu_io(&quick.uri("quick"), &["write -P 0x99 0 1M", "flush"]);
    eprintln!("{:?}: the quick server written", began.elapsed());

    // A writer: 1 MiB i, pattern i+1, then FLUSH; `flushed` counts the ones acknowledged.
    const N: usize = 48;
    let flushed = std::sync::Arc::new(AtomicUsize::new(0));
    let mut tcp = std::net::TcpStream::connect(srv.addr).unwrap();
    let export = handshake(&mut tcp, b"disk").unwrap_or_else(|e| {
        panic!(
            "handshake for export disk at {:?}: {e}; server:\n{}",
            began.elapsed(),
            srv.log()
        )
    });
    let mut c = NbdClient::new(tcp, &export);
    let done = flushed.clone();
    let writer = std::thread::spawn(move || -> Result<(), String> {
        for i in 0..N {
            c.seek(SeekFrom::Start(i as u64 * MIB)).unwrap();
            c.write_all(&vec![i as u8 + 1; MIB as usize])
                .map_err(|e| format!("write {i}: {e}"))?;
            c.flush()
                .map_err(|e| format!("flush after write {i}: {e}"))?;
            done.store(i + 1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    });
    // Mid-run: the OSD killed, then started again a few seconds later.
    let deadline = Instant::now() + Duration::from_secs(60);
    while flushed.load(Ordering::SeqCst) < 8 {
        assert!(Instant::now() < deadline, "the writer does not get going");
        std::thread::sleep(Duration::from_millis(20));
    }
    let osd = ceph.osd_pid();
    // SAFETY: plain kill(2) on the dev cluster's OSD, started again by the guard.
    assert_eq!(unsafe { libc::kill(osd, libc::SIGKILL) }, 0);
    let killed = Killed(&ceph);
    let at_kill = flushed.load(Ordering::SeqCst);
    // Down for a while: the writer's requests wait, the quick server's fail with EIO after
    // its 3 s, the file export serves.
    let t = Instant::now();
    let out = run_with_timeout(
        Command::new("qemu-io").args([
            "-f",
            "raw",
            "-c",
            "write -P 0x98 1M 64k",
            "-c",
            "flush",
            &quick.uri("quick"),
        ]),
        Duration::from_secs(60),
    );
    assert!(text(&out).contains("Input/output error"), "{}", text(&out));
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
    quick.assert_alive("with the OSD down");
    qemu_io(
        &srv.uri("file"),
        &["write -P 0x42 0 1M", "flush", "read -P 0x42 0 1M"],
    );
    let while_down = flushed.load(Ordering::SeqCst);
    assert!(
        while_down <= at_kill + 1,
        "flushes acknowledged with the OSD down: {at_kill} then {while_down}"
    );
    drop(killed);
    writer.join().unwrap().expect("the writer's requests fail");
    // The quick server serves again, its flushed write there.
    serves_again(
        &quick.uri("quick"),
        &["read -P 0x99 0 1M"],
        "the quick server",
    );
    stop(quick);
    assert_eq!(flushed.load(Ordering::SeqCst), N);
    srv.assert_alive("after the OSD came back");
    srv.kill9();
    // Every flushed write is in the cluster.
    let disk = ceph.export(&img.name, dir.path());
    for i in 0..N {
        let at = i * MIB as usize;
        assert!(
            disk[at..at + MIB as usize]
                .iter()
                .all(|&b| b == i as u8 + 1),
            "flushed write {i} is not in the image"
        );
    }
}

/// A sparse upload into an RBD export (issue 25): `qemu-img convert -n` and `nbdcopy` of an
/// image with holes of 40 MiB, 128 MiB and 2 GiB — longer than the maximum block size, so
/// each is one WRITE_ZEROES or TRIM past it — over data written into those holes first; the
/// export then compares identical to the source.
#[test]
fn rbd_sparse_uploads_with_qemu_img_and_nbdcopy() {
    let _turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ceph) = Ceph::get() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (src, size) = sparse_upload_source(dir.path());
    let src_s = src.to_str().unwrap();
    let img = ceph.image("sparse", size);
    let srv = start_server_v4(&ceph.server_args(&[("disk", &img.name)]));
    let uri = srv.uri("disk");
    for tool in ["qemu-img", "nbdcopy"] {
        let junk = junk_in_upload_holes();
        qemu_io(&uri, &junk.iter().map(String::as_str).collect::<Vec<_>>());
        match tool {
            "qemu-img" => {
                drop(peer_ok(Command::new("qemu-img").args([
                    "convert", "-n", "-f", "raw", "-O", "raw", src_s, &uri,
                ])))
            }
            _ => drop(peer_ok(Command::new("nbdcopy").args([src_s, &uri]))),
        }
        let cmp = run_with_timeout(
            Command::new("qemu-img").args(["compare", "-f", "raw", "-F", "raw", src_s, &uri]),
            Duration::from_secs(300),
        );
        assert!(
            cmp.status.success(),
            "{tool} into the rbd export: {}",
            text(&cmp)
        );
    }
    stop(srv);
}

/// The image's size as `rbd info` says.
fn rbd_size(ceph: &Ceph, image: &str) -> u64 {
    let info = peer_ok(
        ceph.rbd()
            .args(["info", "--format", "json", &ceph.spec(image)]),
    );
    let at = info
        .find("\"size\":")
        .expect("rbd info --format json has a size")
        + 7;
    let digits: String = info[at..]
        .chars()
        .skip_while(|c| c.is_whitespace())
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().unwrap()
}

/// `qpip-nbd resize URI SIZE`: its output, and whether it succeeded.
fn qpip_nbd_resize(uri: &str, size: &str) -> (bool, String) {
    let bin = qpip_test_support::bins::workspace_bin("nbd-client", "qpip-nbd");
    let out = run_with_timeout(
        Command::new(bin).args(["resize", uri, size]),
        Duration::from_secs(60),
    );
    (out.status.success(), text(&out))
}

#[test]
fn rbd_nbd_resize_extension_grows_and_shrinks_the_image() {
    use nbd::client::handshake;

    let _turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ceph) = Ceph::get() else { return };
    let img = ceph.image("nbdresize", 32 * MIB);
    let args = ceph.server_args(&[("disk", &img.name)]);
    let srv = start_server_v4(&args);
    let uri = srv.uri("disk");
    qemu_io(&uri, &["write -P 0x21 0 1M", "flush"]);

    // Grow through NBD: the image grows, the connection that asked may use it at once
    // (qpip-nbd's own check would refuse it otherwise), and new connections are told.
    let (ok, out) = qpip_nbd_resize(&uri, "64M");
    assert!(ok, "{out}");
    assert_eq!(rbd_size(&ceph, &img.name), 64 * MIB);
    assert!(
        srv.log()
            .contains("resized from 33554432 to 67108864 bytes by a client (NBD_CMD_RESIZE)"),
        "{}",
        srv.log()
    );
    serves_64m(&uri, 0x22, "read -P 0x21 0 1M");

    // qemu's NBD driver has no way to ask (it sends no NBD_CMD_RESIZE).
    let q = run_with_timeout(
        Command::new("qemu-img").args(["resize", "-f", "raw", &uri, "96M"]),
        Duration::from_secs(60),
    );
    assert!(!q.status.success(), "{}", text(&q));
    assert!(text(&q).contains("Cannot resize NBD nodes"), "{}", text(&q));
    assert_eq!(rbd_size(&ceph, &img.name), 64 * MIB);

    // A shrink while another connection is open: EPERM, as the extension allows; the image
    // keeps its size.
    let mut other = std::net::TcpStream::connect(srv.addr).unwrap();
    handshake(&mut other, b"disk").unwrap();
    let (ok, out) = qpip_nbd_resize(&uri, "16M");
    // The server's reason reaches the client, in the error chunk's message.
    assert!(
        !ok && out.contains("EPERM")
            && out.contains("a shrink while another connection uses the image"),
        "{out}"
    );
    assert_eq!(rbd_size(&ceph, &img.name), 64 * MIB);
    drop(other);

    // Alone (once the server has seen the other one go): shrunk, as `rbd resize
    // --allow-shrink` would; past the new end, new connections get EINVAL.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (ok, out) = qpip_nbd_resize(&uri, "16M");
        if ok {
            break;
        }
        assert!(out.contains("EPERM") && Instant::now() < deadline, "{out}");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(rbd_size(&ceph, &img.name), 16 * MIB);
    wait_for_size(&uri, 16 * MIB);
    qemu_io(&uri, &["read -P 0x21 0 1M"]);
    read_past_16m_fails(&uri);

    // Exports that cannot resize do not offer it: a read-only one.
    let mut ro_args = args.clone();
    ro_args.push("--read-only".into());
    let ro = start_server_v4(&ro_args);
    let (ok, out) = qpip_nbd_resize(&ro.uri("disk"), "32M");
    assert!(!ok && out.contains("does not offer"), "{out}");
    assert_eq!(rbd_size(&ceph, &img.name), 16 * MIB);
    stop(ro);
    stop(srv);
}

/// A qpip-nbd-mount process, unmounted (and waited for) when dropped.
struct RbdMount {
    child: std::process::Child,
    dir: PathBuf,
    log: PathBuf,
}

impl RbdMount {
    fn start(uri: &str, dir: &Path, log: &Path) -> RbdMount {
        let bin = qpip_test_support::bins::workspace_bin("fuse-mount", "qpip-nbd-mount");
        let child = Command::new(bin)
            .args(["-v", uri])
            .arg(dir)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap();
        RbdMount {
            child,
            dir: dir.to_path_buf(),
            log: log.to_path_buf(),
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `file` in the mount is `size` bytes long (stat, a fresh lookup).
    fn wait_for_size(&self, file: &Path, size: u64, secs: u64) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let now = std::fs::metadata(file).map(|m| m.len()).ok();
            if now == Some(size) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} is {now:?} bytes, not {size}, after {secs} s:\n{}",
                file.display(),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for RbdMount {
    fn drop(&mut self) {
        let _ = Command::new("fusermount3")
            .arg("-u")
            .arg(&self.dir)
            .status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn rbd_mount_follows_a_grow_across_a_restart_and_drops_bytes_past_a_shrink() {
    use std::os::unix::fs::FileExt;

    let _turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ceph) = Ceph::get() else { return };
    if !require(&["fusermount3"]) {
        return;
    }
    if !root("a FUSE mount") {
        return;
    }
    if !Path::new("/dev/fuse").exists() {
        missing("FUSE (/dev/fuse), for qpip-nbd-mount");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let file = mnt.join("disk");
    let img = ceph.image("mount", 32 * MIB);
    let args = ceph.server_args(&[("disk", &img.name)]);
    let srv = start_server_v4(&args);
    let addr = srv.addr.to_string();
    let uri = srv.uri("disk");
    qemu_io(&uri, &["write -P 0x45 30M 4k", "flush"]);

    let mount = RbdMount::start(&uri, &mnt, &dir.path().join("mount.log"));
    mount.wait_for_size(&file, 32 * MIB, 30);
    // Opened before both resizes, and its page at 30 MiB in the page cache.
    let early = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&file)
        .unwrap();
    let mut page = vec![0u8; 4096];
    early.read_exact_at(&mut page, 30 * MIB).unwrap();
    assert!(page.iter().all(|&b| b == 0x45));

    // Grow while the server is down; it comes back on the same address, told 64 MiB.
    stop(srv);
    rbd_resize(&ceph, &img.name, "64M", false);
    let srv = start_server(&addr, &args);
    // The mount asks the server every 2 s; a reconnect would tell it too.
    mount.wait_for_size(&file, 64 * MIB, 20);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&file)
        .unwrap();
    f.write_all_at(&[0x47; 4096], 60 * MIB).unwrap();
    f.sync_all().unwrap();
    drop(f);
    qemu_io(&uri, &["read -P 0x47 60M 4k", "read -P 0x45 30M 4k"]);
    assert!(mount.log().contains("the file follows"), "{}", mount.log());

    // Shrink under the running server and the open mount: no byte past the new end is
    // served again, not even the page the kernel cached.
    rbd_resize(&ceph, &img.name, "16M", true);
    mount.wait_for_size(&file, 16 * MIB, 20);
    let f = std::fs::File::open(&file).unwrap();
    let n = f.read_at(&mut page, 30 * MIB).unwrap();
    assert_eq!(n, 0, "a read past the new end of a fresh open");
    // The file opened before keeps its size under the writeback cache (the kernel's), but
    // its cached page is gone: zeroes or an error, never the old bytes.
    match early.read_at(&mut page, 30 * MIB) {
        Ok(n) => assert!(
            page[..n].iter().all(|&b| b != 0x45),
            "stale bytes past the new end through a file opened before the shrink"
        ),
        Err(e) => assert!(
            matches!(e.raw_os_error(), Some(libc::EIO | libc::EINVAL)),
            "{e}"
        ),
    }
    let mut head = vec![0u8; 4096];
    f.read_exact_at(&mut head, 0).unwrap();
    drop((f, early));
    drop(mount);
    stop(srv);
}

#[test]
fn rbd_read_only_mount_takes_a_grow_when_it_reconnects() {
    use std::os::unix::fs::FileExt;

    let _turn = TURNS.lock().unwrap_or_else(|e| e.into_inner());
    let Some(ceph) = Ceph::get() else { return };
    if !require(&["fusermount3"]) || !root("a FUSE mount") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let file = mnt.join("disk");
    let img = ceph.image("romount", 32 * MIB);
    // Read-only: no RESIZE offered, so the mount does not ask; only a reconnect tells it.
    let mut args = ceph.server_args(&[("disk", &img.name)]);
    args.push("--read-only".into());
    let srv = start_server_v4(&args);
    let addr = srv.addr.to_string();
    let mount = RbdMount::start(&srv.uri("disk"), &mnt, &dir.path().join("mount.log"));
    mount.wait_for_size(&file, 32 * MIB, 30);
    stop(srv);
    rbd_resize(&ceph, &img.name, "48M", false);
    let srv = start_server(&addr, &args);
    // Nothing has asked yet: the size stays.
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 32 * MIB);
    // A read the page cache does not hold goes to the server: the connection is found
    // closed, made again, and told 48 MiB.
    let mut b = vec![0u8; 4096];
    std::fs::File::open(&file)
        .unwrap()
        .read_exact_at(&mut b, 8 * MIB)
        .unwrap();
    mount.wait_for_size(&file, 48 * MIB, 20);
    assert!(
        mount
            .log()
            .contains("size changed from 33554432 to 50331648 bytes while reconnecting"),
        "{}",
        mount.log()
    );
    drop(mount);
    stop(srv);
}

/// qemu-io's read just past 16 MiB fails: the export ends there.
fn read_past_16m_fails(uri: &str) {
    let out = run_with_timeout(
        Command::new("qemu-io").args(["-f", "raw", "-c", "read 16M 4k", uri]),
        Duration::from_secs(60),
    );
    assert!(
        !out.status.success() || text(&out).contains("failed"),
        "{}",
        text(&out)
    );
}

/// New connections to `uri` are told 64 MiB and use all of it: a write at 60 MiB with
/// `pattern` reads back, and `old` (a qemu-io read) still finds what was there before.
fn serves_64m(uri: &str, pattern: u8, old: &str) {
    wait_for_size(uri, 64 * MIB);
    let length = qemu_io(uri, &["length"]);
    assert!(length.contains("64 MiB"), "{length}");
    let write = format!("write -P {pattern:#x} 60M 1M");
    let read = format!("read -P {pattern:#x} 60M 1M");
    qemu_io(uri, &[write.as_str(), "flush", read.as_str(), old]);
}

/// `rbd resize` of image `name` to `size` (`--allow-shrink` when `shrink`).
fn rbd_resize(ceph: &Ceph, name: &str, size: &str, shrink: bool) {
    let mut args = vec!["resize", "--no-progress", "--size", size];
    if shrink {
        args.push("--allow-shrink");
    }
    let spec = ceph.spec(name);
    args.push(&spec);
    peer_ok(ceph.rbd().args(&args));
}
