//! qcow2 persistent dirty bitmaps served as `qemu:dirty-bitmap:NAME` (`-B`, issue 35 item 1),
//! compared with qemu-nbd on the same images through nbdinfo, text for text: fresh bitmaps,
//! after writes through qemu-io, several at once (one disabled, one at another granularity),
//! down a backing chain; writes through our server set the bits as qemu-nbd's set them, and
//! qemu-img and qemu-nbd agree with us afterwards; a crash leaves the bitmaps in use, refused
//! by both; crafted bitmap directories are refused with one line.

mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

use common::*;
use qpip_test_support::servers::qpip_server;

const MIB: u64 = 1 << 20;

/// `file` in `d`: 16 MiB with bitmaps b0 (enabled), b1 (disabled after some writes) and b2
/// (enabled, 1 MiB granularity), written through qemu-io.
fn bitmapped(d: &Path, file: &str) {
    qemu_img_in(d, &["create", "-q", "-f", "qcow2", file, "16M"]);
    qemu_img_in(d, &["bitmap", "--add", file, "b0"]);
    qemu_img_in(d, &["bitmap", "--add", file, "b1"]);
    qemu_img_in(d, &["bitmap", "--add", "-g", "1M", file, "b2"]);
    qemu_io_in(
        d,
        "qcow2",
        file,
        &[
            "write -P 1 1M 64k",
            "write -z 5M 8k",
            "discard 9M 1M",
            "write 16383k 512",
        ],
    );
    qemu_img_in(d, &["bitmap", "--disable", file, "b1"]);
    qemu_io_in(d, "qcow2", file, &["write -P 2 12M 4k"]);
}

/// The metadata contexts nbdinfo lists.
fn contexts(peer: &Peer) -> Vec<String> {
    nbdinfo(&[], peer)
        .lines()
        .skip_while(|l| !l.contains("contexts:"))
        .skip(1)
        .take_while(|l| l.starts_with("\t\t"))
        .map(|l| l.trim().to_string())
        .collect()
}

/// `-B NAME` for each of `bitmaps`.
fn b_flags<'a>(bitmaps: &[&'a str]) -> Vec<&'a str> {
    bitmaps.iter().flat_map(|b| ["-B", *b]).collect()
}

/// What nbdinfo shows of `bitmaps` on `peer`: each one's map, with totals.
fn maps(peer: &Peer, bitmaps: &[&str]) -> Vec<String> {
    bitmaps
        .iter()
        .flat_map(|b| {
            let m = format!("--map=qemu:dirty-bitmap:{b}");
            [nbdinfo(&[&m], peer), nbdinfo(&[&m, "--totals"], peer)]
        })
        .collect()
}

/// Stops a server as a user does (SIGTERM), so that it closes its image cleanly.
fn stop(peer: &mut Peer) {
    // SAFETY: kill(2) on the pid of a child this test started and has not reaped.
    unsafe { libc::kill(peer.child.id() as libc::pid_t, libc::SIGTERM) };
    let _ = peer.child.wait();
}

/// The bitmaps section of `qemu-img info`.
fn bitmaps_info(d: &Path, file: &str) -> String {
    let info = qemu_img_in(d, &["info", file]);
    info.lines()
        .skip_while(|l| !l.contains("bitmaps:"))
        .take_while(|l| !l.contains("refcount bits"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn bitmaps_are_served_as_qemu_nbd_serves_them() {
    if !require(&["qemu-nbd", "qemu-img", "qemu-io", "nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    qemu_img_in(d, &["create", "-q", "-f", "qcow2", "fresh.qcow2", "16M"]);
    qemu_img_in(d, &["bitmap", "--add", "fresh.qcow2", "b0"]);
    bitmapped(d, "bm.qcow2");
    // A chain: top.qcow2 (bitmap t0, written partly over clusters of its base: copy-on-write)
    // over bm.qcow2, whose bitmaps qemu-nbd finds down the chain.
    qemu_img_in(
        d,
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            "bm.qcow2",
            "-F",
            "qcow2",
            "top.qcow2",
        ],
    );
    qemu_img_in(d, &["bitmap", "--add", "-g", "128k", "top.qcow2", "t0"]);
    qemu_io_in(
        d,
        "qcow2",
        "top.qcow2",
        &[
            "write -P 3 1056k 4k",
            "write -z 4M 1M",
            "write -P 4 15M 300k",
        ],
    );
    let cases: [(&str, &[&str]); 5] = [
        ("fresh.qcow2", &["b0"]),
        ("bm.qcow2", &["b0"]),
        ("bm.qcow2", &["b1", "b0", "b2"]),
        ("top.qcow2", &["t0"]),
        ("top.qcow2", &["t0", "b2", "b1"]),
    ];
    let mut differ = Vec::new();
    for (file, bitmaps) in cases {
        for a in [&[][..], &["-A"][..]] {
            let flags = [a, &b_flags(bitmaps)[..]].concat();
            let Some(theirs) = qemu_nbd_x(d, file, "qcow2", &[&["-r"], &flags[..]].concat()) else {
                return;
            };
            let ours = qpip_server("x", &d.join(file), &[&["-r"], &flags[..]].concat());
            let (q, o) = (contexts(&theirs), contexts(&ours));
            if q != o {
                differ.push(format!(
                    "{file} {flags:?} contexts: qemu-nbd {q:?}, ours {o:?}"
                ));
            }
            for (q, o) in maps(&theirs, bitmaps).into_iter().zip(maps(&ours, bitmaps)) {
                if q != o {
                    differ.push(format!(
                        "{file} {flags:?}:\nqemu-nbd:\n{q}\nqpip-nbd-server:\n{o}"
                    ));
                }
            }
        }
    }
    assert!(differ.is_empty(), "{}", differ.join("\n\n"));
}

/// The same guest writes through qemu-nbd and through our server, on copies of one image
/// (and of a chain's top): the same dirty extents while serving, the same bitmaps (flags,
/// granularity) in qemu-img info after a clean stop, qemu-img check clean, the same disks,
/// and qemu-nbd reading back from our image what we served.
#[test]
fn writes_through_our_server_set_the_bits_qemu_nbd_sets() {
    if !require(&["qemu-nbd", "qemu-img", "qemu-io", "nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    bitmapped(d, "base.qcow2");
    qemu_img_in(
        d,
        &[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-b",
            "base.qcow2",
            "-F",
            "qcow2",
            "top.qcow2",
        ],
    );
    qemu_img_in(d, &["bitmap", "--add", "top.qcow2", "b0"]);
    let writes = [
        "write -P 7 3M 100k",
        "write -z 6M 1M",
        "discard 10M 64k",
        "write -P 8 16383k 1k",
        "write -P 9 2047k 2k",
        "write -P 10 1040k 4k",
    ];
    let all = ["b0", "b1", "b2"];
    for (image, bitmaps) in [("base.qcow2", &all[..]), ("top.qcow2", &["b0"][..])] {
        let (q_img, o_img) = (format!("q-{image}"), format!("o-{image}"));
        std::fs::copy(d.join(image), d.join(&q_img)).unwrap();
        std::fs::copy(d.join(image), d.join(&o_img)).unwrap();
        // qemu-nbd ignores TRIM unless told otherwise; a trim dirties the range it unmaps.
        let flags = [&["--discard", "unmap"][..], &b_flags(bitmaps)].concat();
        let Some(mut theirs) = qemu_nbd_x(d, &q_img, "qcow2", &flags) else {
            return;
        };
        qemu_io(&theirs.uri, &writes);
        let q_live = maps(&theirs, bitmaps);
        stop(&mut theirs);
        let mut ours = qpip_server("x", &d.join(&o_img), &flags);
        qemu_io(&ours.uri, &writes);
        let o_live = maps(&ours, bitmaps);
        stop(&mut ours);
        assert_eq!(q_live, o_live, "{image}: live dirty extents differ");
        check_clean_in(&o_img, d);
        assert_eq!(
            bitmaps_info(d, &q_img),
            bitmaps_info(d, &o_img),
            "{image}: qemu-img info's bitmaps differ"
        );
        assert!(!bitmaps_info(d, &o_img).contains("in-use"));
        qemu_img_in(d, &["compare", &q_img, &o_img]);
        let Some(after) = qemu_nbd_x(
            d,
            &o_img,
            "qcow2",
            &[&["-r"], &b_flags(bitmaps)[..]].concat(),
        ) else {
            return;
        };
        assert_eq!(
            maps(&after, bitmaps),
            o_live,
            "{image}: qemu-nbd reads back"
        );
    }
}

/// kill -9 while the bitmaps are in use: qemu-img info shows them in use, and both servers
/// refuse them as inconsistent, with one line; the image itself is still served and checks
/// clean, and a later clean run leaves the inconsistent bitmap as it is (as qemu does).
#[test]
fn a_crash_leaves_the_bitmaps_in_use_and_both_servers_refuse_them() {
    if !require(&["qemu-nbd", "qemu-img", "qemu-io", "nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    bitmapped(d, "bm.qcow2");
    let path = d.join("bm.qcow2");
    let mut ours = qpip_server("x", &path, &["-B", "b0"]);
    qemu_io(&ours.uri, &["write -P 5 2M 64k"]);
    ours.kill();
    let info = bitmaps_info(d, "bm.qcow2");
    assert_eq!(info.matches("in-use").count(), 3, "{info}");
    check_clean_in("bm.qcow2", d);
    let p = path.to_str().unwrap();
    let theirs = peer_fails(Command::new("qemu-nbd").args(["-r", "-f", "qcow2", "-B", "b0", p]));
    assert!(theirs.contains("'b0' is inconsistent"), "{theirs}");
    let refused = peer_fails(Command::new(BIN).args([
        "--listen",
        "127.0.0.1:0",
        "--log",
        "warn",
        "-r",
        "-B",
        "b0",
        p,
    ]));
    assert_one_line(&refused, &["bm.qcow2", "\"b0\" is inconsistent"]);
    // Without -B the image is served, written, and closed; the in-use bitmaps stay so.
    let mut again = qpip_server("x", &path, &[]);
    qemu_io(&again.uri, &["write -P 6 3M 4k"]);
    stop(&mut again);
    check_clean_in("bm.qcow2", d);
    assert_eq!(bitmaps_info(d, "bm.qcow2"), info);
}

/// `text`, the output of a server that refused to start, is one line (besides nothing)
/// containing each of `want`, and no panic.
fn assert_one_line(text: &str, want: &[&str]) {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{text}");
    for w in want {
        assert!(lines[0].contains(w), "{w:?} not in {text}");
    }
    assert!(!text.contains("panicked"), "{text}");
}

/// A bitmap that does not exist is refused at start by both servers; on a raw image, with one
/// line saying raw images have none; the config file's `bitmap = [...]` offers one per export.
#[test]
fn missing_bitmaps_raw_images_and_the_config_file() {
    if !require(&["qemu-nbd", "qemu-img", "qemu-io", "nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    bitmapped(d, "bm.qcow2");
    image(d, "a.raw", MIB);
    let p = d.join("bm.qcow2").display().to_string();
    let serve = |extra: &[&str]| {
        peer_fails(
            Command::new(BIN)
                .args(["--listen", "127.0.0.1:0", "--log", "warn", "-r"])
                .args(extra),
        )
    };
    let theirs = peer_fails(Command::new("qemu-nbd").args(["-r", "-f", "qcow2", "-B", "no", &p]));
    assert!(theirs.contains("'no' is not found"), "{theirs}");
    assert_one_line(
        &serve(&["-B", "no", &p]),
        &["bm.qcow2", "\"no\" is not found"],
    );
    let raw = d.join("a.raw").display().to_string();
    assert_one_line(
        &serve(&["-B", "b0", &raw]),
        &["a.raw", "raw image has no dirty bitmaps"],
    );
    let cfg = d.join("server.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[export]]\nname = \"a\"\npath = \"{p}\"\nread_only = true\nbitmap = [\"b0\", \"b2\"]\n\n\
             [[export]]\nname = \"b\"\npath = \"{p}\"\nread_only = true\n",
        ),
    )
    .unwrap();
    let srv = start_server_v4(&args(&["--config", cfg.to_str().unwrap()]));
    let listed = |export: &str| {
        let out = peer_ok(Command::new("nbdinfo").arg(srv.uri(export)));
        out.lines()
            .skip_while(|l| !l.contains("contexts:"))
            .skip(1)
            .take_while(|l| l.starts_with("\t\t"))
            .map(|l| l.trim().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        listed("a"),
        [
            "base:allocation",
            "qemu:dirty-bitmap:b2",
            "qemu:dirty-bitmap:b0"
        ]
    );
    assert_eq!(listed("b"), ["base:allocation"]);
}

/// The bitmaps extension's data in `img` (its offset in the file), found by walking the
/// header extensions.
fn bitmaps_ext(img: &[u8]) -> usize {
    let be32 = |at: usize| u32::from_be_bytes(img[at..at + 4].try_into().unwrap());
    let mut at = be32(100) as usize;
    loop {
        let (ty, len) = (be32(at), be32(at + 4) as usize);
        assert_ne!(ty, 0, "no bitmaps extension");
        if ty == 0x2385_2875 {
            return at + 8;
        }
        at += 8 + len.next_multiple_of(8);
    }
}

/// Crafted bitmap directories (past the end of the file, huge, too many bitmaps, a huge or
/// misplaced table, a name running past the directory, bits past the end of the file) are
/// refused with one line naming the image, read-only or writable, without a panic or a
/// huge allocation; the image is left as it was.
#[test]
fn crafted_bitmap_directories_are_refused_with_one_line() {
    if !require(&["qemu-img"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    qemu_img_in(d, &["create", "-q", "-f", "qcow2", "good.qcow2", "16M"]);
    qemu_img_in(d, &["bitmap", "--add", "good.qcow2", "b0"]);
    let good = std::fs::read(d.join("good.qcow2")).unwrap();
    let ext = bitmaps_ext(&good);
    let be64 = |at: usize| u64::from_be_bytes(good[at..at + 8].try_into().unwrap());
    let dir_at = be64(ext + 16) as usize;
    let table_at = be64(dir_at) as usize;
    let put = |img: &mut Vec<u8>, at: usize, v: &[u8]| img[at..at + v.len()].copy_from_slice(v);
    type Craft = Box<dyn Fn(&mut Vec<u8>)>;
    let len = good.len() as u64;
    let crafts: Vec<(&str, Craft)> = vec![
        (
            "past-end",
            Box::new(move |i| {
                put(
                    i,
                    ext + 16,
                    &(len.next_multiple_of(65536) + 65536).to_be_bytes(),
                )
            }),
        ),
        (
            "huge-dir",
            Box::new(move |i| put(i, ext + 8, &(1u64 << 40).to_be_bytes())),
        ),
        (
            "many",
            Box::new(move |i| put(i, ext, &u32::MAX.to_be_bytes())),
        ),
        (
            "huge-table",
            Box::new(move |i| put(i, dir_at + 8, &0x7fff_ffffu32.to_be_bytes())),
        ),
        (
            "unaligned-table",
            Box::new(move |i| put(i, dir_at, &12345u64.to_be_bytes())),
        ),
        (
            "long-name",
            Box::new(move |i| put(i, dir_at + 18, &u16::MAX.to_be_bytes())),
        ),
        (
            "bits-past-end",
            Box::new(move |i| put(i, table_at, &(1u64 << 50).to_be_bytes())),
        ),
    ];
    for (name, craft) in crafts {
        let mut img = good.clone();
        craft(&mut img);
        let file = format!("{name}.qcow2");
        std::fs::write(d.join(&file), &img).unwrap();
        for ro in [true, false] {
            let out = peer_fails(
                Command::new(BIN)
                    .args(["--listen", "127.0.0.1:0", "--log", "warn"])
                    .args(if ro { &["-r"][..] } else { &[] })
                    .arg(d.join(&file)),
            );
            assert_one_line(&out, &[&file, "bitmap"]);
        }
        assert!(
            std::fs::read(d.join(&file)).unwrap() == img,
            "{file} changed"
        );
    }
}

/// `qpip-nbd copy ARGS`.
fn copy(args: &[&str]) -> String {
    let bin = qpip_test_support::bins::workspace_bin("nbd-client", "qpip-nbd");
    peer_ok(Command::new(bin).arg("copy").args(args))
}

/// An incremental backup end to end (issue 35 item 7), through our server and through
/// qemu-nbd: a full backup with qpip-nbd copy when the bitmap is made, guest writes through
/// the export, then only the dirty extents copied onto the previous backup (a marker put in
/// a clean range of it stays: nothing else is copied), and the restored image equal to the
/// disk (qemu-img compare); both servers report the same dirty extents.
#[test]
fn an_incremental_backup_copies_the_dirty_extents_only() {
    if !require(&["qemu-nbd", "qemu-img", "qemu-io", "nbdinfo"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    qemu_img_in(d, &["create", "-q", "-f", "qcow2", "disk.qcow2", "32M"]);
    qemu_io_in(
        d,
        "qcow2",
        "disk.qcow2",
        &["write -P 1 0 4M", "write -P 2 8M 2M", "write -P 3 30M 2M"],
    );
    qemu_img_in(d, &["bitmap", "--add", "disk.qcow2", "b0"]);
    std::fs::copy(d.join("disk.qcow2"), d.join("q-disk.qcow2")).unwrap();
    let guest = [
        "write -P 4 1M 64k",
        "write -P 5 9M 4k",
        "write -z 30M 1M",
        "discard 2M 1M",
        "write -P 6 20M 1536k",
        "write -P 7 32767k 1k",
    ];
    let ctx = "qemu:dirty-bitmap:b0";
    let mut dirty = Vec::new();
    for (image, ours) in [("disk.qcow2", true), ("q-disk.qcow2", false)] {
        let flags = ["--discard", "unmap", "-B", "b0"];
        let mut srv = if ours {
            qpip_server("x", &d.join(image), &flags)
        } else {
            let Some(p) = qemu_nbd_x(d, image, "qcow2", &flags) else {
                return;
            };
            p
        };
        let full = d.join(format!("{image}.full.raw"));
        let full = full.to_str().unwrap();
        copy(&[&srv.uri, full]);
        qemu_io(&srv.uri, &guest);
        dirty.push(nbdinfo(&[&format!("--map={ctx}")], &srv));
        // The previous backup, with a marker in a range the guest left alone.
        let restored = d.join(format!("{image}.restored.raw"));
        std::fs::copy(full, &restored).unwrap();
        let marker = 14 << 20;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&restored)
            .unwrap();
        f.write_all_at(b"not copied", marker).unwrap();
        let restored = restored.to_str().unwrap();
        copy(&["--map", ctx, &srv.uri, restored]);
        stop(&mut srv);
        let back = std::fs::read(restored).unwrap();
        assert_eq!(&back[marker as usize..marker as usize + 10], b"not copied");
        // The marker put back as the full backup has it: the restored disk is the disk.
        f.write_all_at(
            &std::fs::read(full).unwrap()[marker as usize..][..10],
            marker,
        )
        .unwrap();
        qemu_img_in(d, &["compare", "-f", "raw", "-F", "qcow2", restored, image]);
    }
    assert_eq!(dirty[0], dirty[1], "dirty extents: ours, then qemu-nbd's");
    assert!(dirty[0].contains("dirty"), "{}", dirty[0]);
}

/// A crafted L2 entry pointing at a bitmap's table: a write through it fails (EIO) and marks
/// the image corrupt, as qemu's overlap check does, and the table is left as it was.
#[test]
fn a_write_onto_a_bitmap_table_is_refused() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    qemu_img_in(d, &["create", "-q", "-f", "qcow2", "bm.qcow2", "16M"]);
    qemu_io_in(d, "qcow2", "bm.qcow2", &["write -P 1 0 64k"]);
    qemu_img_in(d, &["bitmap", "--add", "bm.qcow2", "b0"]);
    let path = d.join("bm.qcow2");
    let mut img = std::fs::read(&path).unwrap();
    let be64 = |b: &[u8], at: usize| u64::from_be_bytes(b[at..at + 8].try_into().unwrap());
    let mask = 0x00ff_ffff_ffff_fe00u64;
    let l2 = (be64(&img, be64(&img, 40) as usize) & mask) as usize;
    let ext = bitmaps_ext(&img);
    let table = be64(&img, be64(&img, ext + 16) as usize);
    img[l2..l2 + 8].copy_from_slice(&(table | 1 << 63).to_be_bytes());
    std::fs::write(&path, &img).unwrap();
    let before = img[table as usize..table as usize + 4096].to_vec();
    let srv = qpip_server("x", &path, &[]);
    let out = text(&run_with_timeout(
        Command::new("qemu-io").args(["-f", "raw", "-c", "write -P 9 0 4k", &srv.uri]),
        std::time::Duration::from_secs(30),
    ));
    assert!(out.contains("write failed"), "{out}");
    drop(srv);
    let after = std::fs::read(&path).unwrap();
    assert_eq!(after[table as usize..table as usize + 4096], before[..]);
    let incompat = be64(&after, 72);
    assert_ne!(incompat & 2, 0, "not marked corrupt");
}
