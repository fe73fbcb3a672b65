//! Crafted qcow2 images against the store, on stable Rust and in every test run: images made
//! by qemu-img (plain, with data, compressed, with an L2 table per few clusters), their
//! metadata mutated a few thousand times by a seeded generator, each opened as qcow2 and,
//! where it opens, read, written, zeroed, trimmed and asked for block status at random. The
//! store may refuse an image or answer an error; it must never panic, hang or allocate what
//! the image asks for (the process's peak RSS is checked at the end).

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use nbd_server::store::open::{Format, OpenOptions, Opener};
use qpip_test_support::pattern::Rng;

/// An image made by qemu-img with `opts`, then `cmds` run on it with qemu-io.
fn made(dir: &Path, name: &str, opts: &[&str], cmds: &[&str]) -> Vec<u8> {
    let p = dir.join(name);
    let p_s = p.to_str().unwrap();
    let mut c = Command::new("qemu-img");
    c.args(["create", "-q", "-f", "qcow2"])
        .args(opts)
        .args([p_s, "8M"]);
    peer_ok(&mut c);
    for cmd in cmds {
        peer_ok(Command::new("qemu-io").args(["-f", "qcow2", "-c", cmd, p_s]));
    }
    std::fs::read(&p).unwrap()
}

/// Mutates `img`: a few bytes of its first clusters (header, L1, refcount table and blocks,
/// L2 tables) set, flipped or replaced by large values.
fn mutate(rng: &mut Rng, img: &[u8]) -> Vec<u8> {
    let mut v = img.to_vec();
    let meta = v.len().min(64 << 10) as u64;
    for _ in 0..=rng.below(6) {
        let at = rng.below(meta) as usize;
        match rng.below(4) {
            0 => v[at] ^= 1 << rng.below(8),
            1 => v[at] = rng.next_u64() as u8,
            2 => {
                // A big-endian 64-bit field, at an 8-byte boundary, made large or odd.
                let at = at & !7;
                if at + 8 <= v.len() {
                    let x = match rng.below(3) {
                        0 => u64::MAX >> rng.below(40),
                        1 => rng.next_u64(),
                        _ => 1 << rng.below(63),
                    };
                    v[at..at + 8].copy_from_slice(&x.to_be_bytes());
                }
            }
            _ => {
                let at = at & !3;
                if at + 4 <= v.len() {
                    v[at..at + 4].copy_from_slice(&(rng.next_u64() as u32).to_be_bytes());
                }
            }
        }
    }
    if rng.below(8) == 0 {
        v.truncate(rng.below(v.len() as u64) as usize);
    }
    v
}

/// Random I/O on an opened store; errors are answers, panics are bugs.
fn exercise(rng: &mut Rng, store: &dyn nbd_server::store::Store) {
    let size = store.size();
    let buf_len = 128 << 10;
    let mut buf = vec![0u8; buf_len];
    for _ in 0..8 {
        let off = rng.below(size.max(1));
        let len = (rng.below(buf_len as u64) + 1).min(size.saturating_sub(off)) as usize;
        match rng.below(5) {
            0 => drop(store.read_at(&mut buf[..len], off)),
            1 => drop(store.write_at(&buf[..len], off, rng.below(2) == 0)),
            2 => drop(store.write_zeroes(off, len as u64, true, rng.below(2) == 0)),
            3 => drop(store.trim(off, len as u64)),
            _ => drop(store.extents(off, size - off)),
        }
    }
    let _ = store.flush();
}

fn peak_rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

#[test]
fn mutated_qcow2_images_are_refused_or_served_without_panics() {
    if !require(&["qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let bases = [
        made(d, "plain.qcow2", &[], &[]),
        made(
            d,
            "data.qcow2",
            &["-o", "cluster_size=4096"],
            &[
                "write -P 0x11 0 64k",
                "write -P 0x22 3M 8k",
                "write -z 5M 1M",
            ],
        ),
        made(
            d,
            "small.qcow2",
            &["-o", "cluster_size=512,refcount_bits=8"],
            &["write -P 0x33 1M 16k"],
        ),
    ];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let target = d.join("crafted.qcow2");
    let opts = OpenOptions {
        read_only: false,
        format: Some(Format::Qcow2),
        lock: false,
        ..OpenOptions::default()
    };
    let (mut opened, mut refused) = (0, 0);
    for i in 0..3000 {
        let base = &bases[i % bases.len()];
        std::fs::write(&target, mutate(&mut rng, base)).unwrap();
        match Opener::default().open(&target, &opts) {
            Ok(store) => {
                opened += 1;
                exercise(&mut rng, store.as_ref());
            }
            Err(_) => refused += 1,
        }
    }
    eprintln!("{opened} mutated images opened, {refused} refused");
    assert!(
        opened > 100 && refused > 100,
        "{opened} opened, {refused} refused"
    );
    let peak = peak_rss_kib();
    assert!(peak < 512 << 10, "peak RSS {} MiB", peak >> 10);
}
