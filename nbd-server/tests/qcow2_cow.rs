//! Copy on write in qcow2 images with internal snapshots, against qemu: images made only by
//! qemu-img and qemu-io, written through the server, must keep every snapshot's data and
//! stay consistent for `qemu-img check`, as qemu's own writes keep them (issue 34, D3/D4).

mod common;

use std::collections::HashSet;
use std::process::Command;

use common::*;

/// The server on `img` (export `d`).
fn serve(img: &str) -> ServerProcess {
    start_server_v4(&args(&["--export", &format!("d={img}")]))
}

/// D3: a cluster a snapshot shares, zeroed by qemu keeping its allocation (an L2 entry with
/// an offset and the zero flag, without COPIED: refcount 2), then written by a guest: the
/// write goes to a new cluster; the snapshot keeps its data and `qemu-img check` is clean.
#[test]
fn write_to_zeroed_cluster_shared_with_a_snapshot_copies_it() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    qemu_img_in(d, &["create", "-f", "qcow2", "img.qcow2", "1M"]);
    let img = d.join("img.qcow2").to_str().unwrap().to_string();
    qemu_io_in(d, "qcow2", &img, &["write -P 0x5a 0 64k"]);
    qemu_img_in(d, &["snapshot", "-c", "s1", &img]);
    qemu_io_in(d, "qcow2", &img, &["write -z 0 64k"]);

    let srv = serve(&img);
    qemu_io(&srv.uri("d"), &["write -P 0xc3 0 4k"]);
    stop(srv);

    check_clean_in(&img, d);
    let s1 = snapshot_disk(&img, "s1", &d.join("s1.raw"));
    assert!(
        s1[..65536].iter().all(|&b| b == 0x5a),
        "snapshot s1 changed by a write to the active disk"
    );
    qemu_img_in(d, &["convert", "-O", "raw", &img, "active.raw"]);
    let active = std::fs::read(d.join("active.raw")).unwrap();
    assert!(active[..4096].iter().all(|&b| b == 0xc3));
    assert!(active[4096..].iter().all(|&b| b == 0));
}

/// xorshift64*: the differential test's deterministic choices.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn pattern(&mut self) -> u64 {
        1 + self.below(255)
    }
}

/// The virtual disk of the differential test's images: two L2 tables with 4 KiB clusters.
const DISK: u64 = 4 << 20;

/// An offset in one of the hot windows of 8 clusters `cs` (the disk's start, and around the
/// 2 MiB boundary of the 4 KiB-cluster L2 tables), so that the operations meet each other's
/// clusters.
fn hot_offset(rng: &mut Rng, cs: u64, align: u64) -> u64 {
    let window = 8 * cs;
    let base = if rng.chance(50) {
        0
    } else {
        (2 << 20) - window / 2
    };
    (base + rng.below(window)) / align * align
}

/// A random operation in qemu-io's syntax: a write, a zeroing with or without unmap (over
/// NBD: WRITE_ZEROES with and without NO_HOLE), or a discard of whole clusters (TRIM).
/// Returns the command through the server, the command qemu-io applies locally, and the
/// range: a version 2 image over a backing file lets discarded clusters show the backing
/// data in qemu (NBD leaves a trimmed range's contents unspecified; ours reads as zeroes),
/// so locally it is a zeroing there.
fn random_op(rng: &mut Rng, cs: u64, v2_backed: bool) -> (String, String, u64, u64) {
    let align = if rng.chance(50) { cs } else { 512 };
    let off = hot_offset(rng, cs, align);
    let len = (1 + rng.below(3 * cs)).div_ceil(align) * align;
    let len = len.min(DISK - off);
    let op = match rng.below(4) {
        0 => format!("write -P {} {off} {len}", rng.pattern()),
        1 => format!("write -z {off} {len}"),
        2 => format!("write -z -u {off} {len}"),
        _ => {
            let off = off / cs * cs;
            let len = (len.div_ceil(cs) * cs).min(DISK - off);
            let local = if v2_backed {
                format!("write -z {off} {len}")
            } else {
                format!("discard {off} {len}")
            };
            return (format!("discard {off} {len}"), local, off, len);
        }
    };
    (op.clone(), op, off, len)
}

/// A random step of an image's history, in qemu-io's syntax: the operations of
/// [`random_op`], and compressed writes of whole clusters where nothing was written yet
/// (qemu writes compressed clusters only there). `touched`: the clusters written so far.
fn random_history_op(
    rng: &mut Rng,
    cs: u64,
    v2_backed: bool,
    touched: &mut HashSet<u64>,
) -> String {
    let off = hot_offset(rng, cs, cs);
    if rng.chance(25) && touched.insert(off / cs) {
        return format!("write -c -P {} {off} {cs}", rng.pattern());
    }
    let (_, op, off, len) = random_op(rng, cs, v2_backed);
    touched.extend(off / cs..(off + len).div_ceil(cs));
    op
}

/// One seed of the differential test: a random image made by qemu-img and qemu-io (version
/// 2 or 3, 4 KiB or 64 KiB clusters, no, raw or qcow2 backing file, compressed clusters by
/// `qemu-img convert -c` and `write -c`, zeroings keeping and dropping allocations,
/// discards, internal snapshots between the steps), copied twice; the same random
/// operations applied to one copy by qemu-io directly and to the other through the server.
/// Then the active disks and every snapshot's disk are the same, and our copy is clean.
fn differential(seed: u64) {
    let mut rng = Rng::new(seed);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let v2 = rng.chance(40);
    let compat = if v2 { "0.10" } else { "1.1" };
    let cs: u64 = if rng.chance(50) { 4096 } else { 65536 };
    let fmt_opts = format!("compat={compat},cluster_size={cs}");
    let mut recipe = vec![format!("seed {seed}: {fmt_opts}")];
    let backing = match rng.below(3) {
        0 => None,
        k => {
            let (name, fmt) = if k == 1 {
                ("base.raw", "raw")
            } else {
                ("base.qcow2", "qcow2")
            };
            // Sometimes shorter than the disk: past its end, it reads as zeroes.
            let size = if rng.chance(30) { 3 << 20 } else { DISK };
            qemu_img_in(d, &["create", "-f", fmt, name, &size.to_string()]);
            let cmds: Vec<String> = (0..4)
                .map(|_| {
                    let off = hot_offset(&mut rng, cs, 512).min(size - 4096);
                    let len = (1 + rng.below(2 * cs)).min(size - off);
                    format!("write -P {} {off} {len}", rng.pattern())
                })
                .collect();
            qemu_io_in(d, fmt, name, &cmds);
            recipe.push(format!("backing {name} ({size} bytes): {cmds:?}"));
            Some((name, fmt))
        }
    };
    let v2_backed = v2 && backing.is_some();
    let mut touched = HashSet::new();
    if rng.chance(35) {
        // Compressed clusters from a raw source; a backing file set afterwards, unsafely.
        qemu_img_in(d, &["create", "-f", "raw", "src.raw", &DISK.to_string()]);
        let cmds: Vec<String> = (0..5)
            .map(|_| {
                let off = hot_offset(&mut rng, cs, 512);
                let len = (1 + rng.below(4 * cs)).min(DISK - off);
                touched.extend(off / cs..(off + len).div_ceil(cs));
                format!("write -P {} {off} {len}", rng.pattern())
            })
            .collect();
        qemu_io_in(d, "raw", "src.raw", &cmds);
        qemu_img_in(
            d,
            &[
                "convert",
                "-c",
                "-O",
                "qcow2",
                "-o",
                &fmt_opts,
                "src.raw",
                "img.qcow2",
            ],
        );
        recipe.push(format!("convert -c of {cmds:?}"));
        if let Some((name, fmt)) = backing {
            qemu_img_in(d, &["rebase", "-u", "-b", name, "-F", fmt, "img.qcow2"]);
        }
    } else {
        let mut a = vec!["create", "-f", "qcow2", "-o", &fmt_opts];
        if let Some((name, fmt)) = backing {
            a.extend(["-b", name, "-F", fmt]);
        }
        let size = DISK.to_string();
        a.extend(["img.qcow2", &size]);
        qemu_img_in(d, &a);
    }
    let mut snapshots = Vec::new();
    for step in 0..2 + rng.below(5) {
        if rng.chance(55) {
            let name = format!("s{step}");
            qemu_img_in(d, &["snapshot", "-c", &name, "img.qcow2"]);
            recipe.push(format!("snapshot -c {name}"));
            snapshots.push(name);
        }
        let cmds: Vec<String> = (0..1 + rng.below(4))
            .map(|_| random_history_op(&mut rng, cs, v2_backed, &mut touched))
            .collect();
        qemu_io_in(d, "qcow2", "img.qcow2", &cmds);
        recipe.push(format!("qemu-io {cmds:?}"));
    }
    let ops: Vec<(String, String)> = (0..4 + rng.below(10))
        .map(|_| {
            let (remote, local, _, _) = random_op(&mut rng, cs, v2_backed);
            (remote, local)
        })
        .collect();
    recipe.push(format!("then, both ways: {ops:?}"));
    let recipe = recipe.join("\n  ");
    eprintln!("{recipe}");

    std::fs::copy(d.join("img.qcow2"), d.join("ours.qcow2")).unwrap();
    std::fs::copy(d.join("img.qcow2"), d.join("qemus.qcow2")).unwrap();
    let ours = d.join("ours.qcow2").to_str().unwrap().to_string();
    let srv = serve(&ours);
    let remote: Vec<&str> = ops.iter().map(|(r, _)| r.as_str()).collect();
    qemu_io(&srv.uri("d"), &remote);
    stop(srv);
    let local: Vec<String> = ops.into_iter().map(|(_, l)| l).collect();
    qemu_io_in(d, "qcow2", "qemus.qcow2", &local);

    let check = peer_ok(
        Command::new("qemu-img")
            .current_dir(d)
            .args(["check", "ours.qcow2"]),
    );
    assert!(
        check.contains("No errors were found"),
        "{recipe}\nqemu-img check:\n{check}"
    );
    let cmp = qemu_img_in(d, &["compare", "ours.qcow2", "qemus.qcow2"]);
    assert!(cmp.contains("Images are identical"), "{recipe}\n{cmp}");
    for s in &snapshots {
        let a = snapshot_disk(&ours, s, &d.join("ours.raw"));
        let qemus = d.join("qemus.qcow2");
        let b = snapshot_disk(qemus.to_str().unwrap(), s, &d.join("qemus.raw"));
        assert!(a == b, "{recipe}\nsnapshot {s} differs from qemu's");
    }
}

/// The normal suite's seeds: the first twenty, and four more that meet D3's trigger
/// (a cluster a snapshot shares, zeroed keeping its allocation, then written).
const SEEDS: &[u64] = &[
    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 25, 46, 71, 73,
];

/// D4: the differential test over [`SEEDS`]; `QPIP_COW_DIFF_SEEDS=N` runs seeds 0..N
/// instead (the fuzz step's longer run). Every failing seed is reported, with its recipe.
#[test]
fn random_images_and_operations_match_qemu() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let seeds: Vec<u64> = match std::env::var("QPIP_COW_DIFF_SEEDS") {
        Ok(n) => (0..n.parse().expect("QPIP_COW_DIFF_SEEDS: a number")).collect(),
        Err(_) => SEEDS.to_vec(),
    };
    let failed: Vec<u64> = seeds
        .into_iter()
        .filter(|&seed| std::panic::catch_unwind(|| differential(seed)).is_err())
        .collect();
    assert!(failed.is_empty(), "seeds that fail: {failed:?}");
}
