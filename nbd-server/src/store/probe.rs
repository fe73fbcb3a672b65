//! The format probe: what an image file's first bytes say it is, exactly as qemu 10 probes
//! them. qemu (block.c `bdrv_probe_all`) asks every format driver's `.bdrv_probe` for a score
//! and takes the first highest; raw scores 1, so a file is raw only if no other format
//! claims it. Each rule below is one driver's probe, named after qemu's function. The same
//! probe decides a file's format at open and, for an image probed as raw, which guest writes
//! to its first bytes are refused (qemu's raw driver, block/raw-format.c `raw_co_pwritev`).

use std::fs::File;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The magic a qcow2 image starts with.
pub const QCOW2_MAGIC: &[u8; 4] = b"QFI\xfb";

/// How many of an image's first bytes the format probe reads, and so how many a probed raw
/// image's guest may not turn into another format's header: qemu's BLOCK_PROBE_BUF_SIZE,
/// read by `find_image_format` at open and checked by `raw_co_pwritev` (which insists it is
/// 512). qemu reads the bytes past the end of a shorter file as zeroes, and so does
/// [`probe`].
pub const HEAD: u64 = 512;

/// The probed bytes.
type Head = [u8; HEAD as usize];

/// One of qemu's content probes: its score for the probed bytes (0: not its format).
type Score = fn(&Head) -> u32;

/// What the first bytes of an image say it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probed {
    /// A raw image (no header of a known format).
    Raw,
    /// A qcow2 image.
    Qcow2,
    /// A format this server does not serve, by qemu's name for it.
    Other(&'static str),
}

/// qemu's content probes, by format name. Every buffer-size check in them passes: their
/// buffer is always 512 bytes.
const PROBES: &[(&str, Score)] = &[
    ("bochs", bochs),
    ("cloop", cloop),
    ("luks", luks),
    ("parallels", parallels),
    ("qcow", qcow),
    ("qcow2", qcow2),
    ("qed", qed),
    ("vdi", vdi),
    ("vhdx", vhdx),
    ("vmdk", vmdk),
    ("vpc", vpc),
];

/// Probes a file's format from its first bytes `head` and, as qemu does at open, its name
/// (`None` for a guest write: qemu's raw driver probes those without one).
pub fn probe(head: &[u8], name: Option<&Path>) -> Probed {
    // find_image_format: an empty file is raw, unprobed.
    if head.is_empty() {
        return Probed::Raw;
    }
    let mut buf = [0u8; HEAD as usize];
    let n = head.len().min(buf.len());
    buf[..n].copy_from_slice(&head[..n]);
    let mut best: (u32, Option<&'static str>) = (1, None); // raw_probe's score
    for &(format, score) in PROBES {
        let s = score(&buf);
        if s > best.0 {
            best = (s, Some(format));
        }
    }
    if name.is_some_and(dmg) && 2 > best.0 {
        best = (2, Some("dmg"));
    }
    match best.1 {
        None => Probed::Raw,
        Some("qcow2") => Probed::Qcow2,
        Some(other) => Probed::Other(other),
    }
}

fn be32(b: &Head, at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn le32(b: &Head, at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// `strcmp(field, s) == 0` for a field at `at`: `s`, then a NUL.
fn c_str_at(b: &Head, at: usize, s: &[u8]) -> bool {
    b[at..].starts_with(s) && b[at + s.len()] == 0
}

/// block/bochs.c `bochs_probe`: magic, type "Redolog" and subtype "Growing" (each a C
/// string in its field), version 1 or 2.
fn bochs(b: &Head) -> u32 {
    let version = le32(b, 64);
    let yes = c_str_at(b, 0, b"Bochs Virtual HD Image")
        && c_str_at(b, 32, b"Redolog")
        && c_str_at(b, 48, b"Growing")
        && (version == 0x0002_0000 || version == 0x0001_0000);
    if yes { 100 } else { 0 }
}

/// block/cloop.c `cloop_probe`: the whole version 2.0 shell preamble (scores only 2).
fn cloop(b: &Head) -> u32 {
    const MAGIC: &[u8] =
        b"#!/bin/sh\n#V2.0 Format\nmodprobe cloop file=$0 && mount -r -t iso9660 /dev/cloop $1\n";
    if b.starts_with(MAGIC) { 2 } else { 0 }
}

/// block/crypto.c `block_crypto_probe_luks` (crypto/block-luks.c
/// `qcrypto_block_luks_has_format`): the LUKS magic and version 1, big-endian 16 bits.
fn luks(b: &Head) -> u32 {
    if b.starts_with(b"LUKS\xba\xbe\x00\x01") {
        100
    } else {
        0
    }
}

/// block/parallels.c `parallels_probe`: either magic, and version 2.
fn parallels(b: &Head) -> u32 {
    let magic = b.starts_with(b"WithoutFreeSpace") || b.starts_with(b"WithouFreSpacExt");
    if magic && le32(b, 16) == 2 { 100 } else { 0 }
}

/// block/qcow.c `qcow_probe`: the qcow magic and version 1.
fn qcow(b: &Head) -> u32 {
    if b.starts_with(QCOW2_MAGIC) && be32(b, 4) == 1 {
        100
    } else {
        0
    }
}

/// block/qcow2.c `qcow2_probe`: the same magic and any version from 2 (one qemu cannot
/// open included; version 0 is raw).
fn qcow2(b: &Head) -> u32 {
    if b.starts_with(QCOW2_MAGIC) && be32(b, 4) >= 2 {
        100
    } else {
        0
    }
}

/// block/qed.c `bdrv_qed_probe`: the magic "QED\0".
fn qed(b: &Head) -> u32 {
    if b.starts_with(b"QED\0") { 100 } else { 0 }
}

/// block/vdi.c `vdi_probe`: the signature 0xbeda107f, little-endian at 64.
fn vdi(b: &Head) -> u32 {
    if le32(b, 64) == 0xbeda_107f { 100 } else { 0 }
}

/// block/vhdx.c `vhdx_probe`: "vhdxfile".
fn vhdx(b: &Head) -> u32 {
    if b.starts_with(b"vhdxfile") { 100 } else { 0 }
}

/// block/vpc.c `vpc_probe`: "conectix" (the footer copy at the start of a dynamic image).
fn vpc(b: &Head) -> u32 {
    if b.starts_with(b"conectix") { 100 } else { 0 }
}

/// block/vmdk.c `vmdk_probe`: a sparse extent's magic ("COWD", "KDMV"), or a text
/// descriptor: lines starting with '#' and lines of spaces (optionally ending "\r") skipped,
/// then `version=1`, `=2` or `=3` ending in "\n" or "\r\n". Anything else first, an empty
/// line included, is not a descriptor.
fn vmdk(b: &Head) -> u32 {
    if b.starts_with(b"COWD") || b.starts_with(b"KDMV") {
        return 100;
    }
    let mut p = 0;
    while p < b.len() {
        match b[p] {
            b'#' => match b[p..].iter().position(|&c| c == b'\n') {
                Some(nl) => p += nl + 1,
                None => return 0,
            },
            b' ' => {
                while p < b.len() && b[p] == b' ' {
                    p += 1;
                }
                if b.get(p) == Some(&b'\r') {
                    p += 1;
                }
                if b.get(p) != Some(&b'\n') {
                    return 0;
                }
                p += 1;
            }
            _ => {
                let line = &b[p..];
                let version = line.starts_with(b"version=")
                    && matches!(line.get(8), Some(b'1'..=b'3'))
                    && (line[9..].starts_with(b"\n") || line[9..].starts_with(b"\r\n"));
                return if version { 100 } else { 0 };
            }
        }
    }
    0
}

/// block/dmg.c `dmg_probe`, which looks at the file's name only: longer than ".dmg" and
/// ending in it (scores 2). A guest write never meets it.
fn dmg(name: &Path) -> bool {
    let name = name.as_os_str().as_bytes();
    name.len() > 4 && name.ends_with(b".dmg")
}

/// Reads the first [`HEAD`] bytes of `file` (fewer if it is shorter).
pub fn read_head(file: &File) -> io::Result<Vec<u8>> {
    let mut head = vec![0u8; HEAD as usize];
    let mut n = 0;
    while n < head.len() {
        match file.read_at(&mut head[n..], n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    head.truncate(n);
    Ok(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(head: &[u8]) -> Probed {
        probe(head, None)
    }

    /// `head` laid over 512 zero bytes from `at`.
    fn at(at: usize, bytes: &[u8]) -> Vec<u8> {
        let mut b = vec![0u8; HEAD as usize];
        b[at..at + bytes.len()].copy_from_slice(bytes);
        b
    }

    fn with(mut b: Vec<u8>, at: usize, bytes: &[u8]) -> Vec<u8> {
        b[at..at + bytes.len()].copy_from_slice(bytes);
        b
    }

    #[test]
    fn nothing_known_is_raw() {
        assert_eq!(of(b""), Probed::Raw);
        assert_eq!(of(&[0; 512]), Probed::Raw);
        let mut mbr = vec![0u8; 512];
        mbr[510..].copy_from_slice(&[0x55, 0xaa]);
        assert_eq!(of(&mbr), Probed::Raw);
        assert_eq!(of(b"hello\nversion=1\n"), Probed::Raw);
    }

    #[test]
    fn qcow_and_qcow2_by_version() {
        assert_eq!(of(b"QFI\xfb\0\0\0\x03"), Probed::Qcow2);
        assert_eq!(of(b"QFI\xfb\0\0\0\x02"), Probed::Qcow2);
        assert_eq!(of(b"QFI\xfb\xff\xff\xff\xff"), Probed::Qcow2);
        assert_eq!(of(b"QFI\xfb\0\0\0\x01"), Probed::Other("qcow"));
        assert_eq!(of(b"QFI\xfb\0\0\0\0"), Probed::Raw);
        assert_eq!(of(b"QFI\xfb"), Probed::Raw, "version 0, read as zeroes");
    }

    #[test]
    fn qed_vhdx_vpc_luks_by_magic() {
        assert_eq!(of(b"QED\0"), Probed::Other("qed"));
        assert_eq!(
            of(b"QED"),
            Probed::Other("qed"),
            "its NUL read past the end"
        );
        assert_eq!(of(b"QEDX"), Probed::Raw);
        assert_eq!(of(b"vhdxfile"), Probed::Other("vhdx"));
        assert_eq!(of(b"vhdxfil"), Probed::Raw);
        assert_eq!(of(b"conectix"), Probed::Other("vpc"));
        assert_eq!(of(b"Conectix"), Probed::Raw);
        assert_eq!(of(b"LUKS\xba\xbe\0\x01"), Probed::Other("luks"));
        assert_eq!(
            of(b"LUKS\xba\xbe\0\x02"),
            Probed::Raw,
            "LUKS2 is not qemu's"
        );
    }

    #[test]
    fn vdi_by_its_signature_at_64() {
        assert_eq!(of(&at(64, &[0x7f, 0x10, 0xda, 0xbe])), Probed::Other("vdi"));
        assert_eq!(of(&at(0, &[0x7f, 0x10, 0xda, 0xbe])), Probed::Raw);
    }

    #[test]
    fn parallels_by_magic_and_version_2() {
        for magic in [b"WithoutFreeSpace", b"WithouFreSpacExt"] {
            let b = with(at(0, magic), 16, &2u32.to_le_bytes());
            assert_eq!(of(&b), Probed::Other("parallels"));
            assert_eq!(of(&with(b, 16, &3u32.to_le_bytes())), Probed::Raw);
        }
    }

    #[test]
    fn bochs_by_magic_type_subtype_and_version() {
        let b = at(0, b"Bochs Virtual HD Image");
        let b = with(b, 32, b"Redolog");
        let b = with(b, 48, b"Growing");
        assert_eq!(of(&b), Probed::Raw, "version 0");
        for v in [0x0001_0000u32, 0x0002_0000] {
            let b = with(b.clone(), 64, &v.to_le_bytes());
            assert_eq!(of(&b), Probed::Other("bochs"));
            assert_eq!(of(&with(b.clone(), 48, b"Undoable")), Probed::Raw);
            // Each a C string: no NUL after the magic, not the magic.
            assert_eq!(of(&with(b, 22, b"!")), Probed::Raw);
        }
    }

    #[test]
    fn cloop_by_its_whole_preamble() {
        let magic: &[u8] = b"#!/bin/sh\n#V2.0 Format\nmodprobe cloop file=$0 && mount -r -t iso9660 /dev/cloop $1\n";
        assert_eq!(of(magic), Probed::Other("cloop"));
        assert_eq!(of(&magic[..magic.len() - 1]), Probed::Raw);
        assert_eq!(of(b"#!/bin/sh\n#V2.0 Format\nmodprobe cloop"), Probed::Raw);
    }

    #[test]
    fn vmdk_by_magic_or_text_descriptor() {
        assert_eq!(of(b"KDMV"), Probed::Other("vmdk"));
        assert_eq!(of(b"COWD"), Probed::Other("vmdk"));
        let vmdk = |t: &[u8]| of(t) == Probed::Other("vmdk");
        assert!(vmdk(b"# Disk DescriptorFile\nversion=1\n"));
        assert!(vmdk(b"version=1\nRW 8 FLAT \"/etc/hostname\" 0\n"));
        assert!(vmdk(b"version=2\r\n"));
        assert!(vmdk(b"version=3\n"));
        assert!(vmdk(b"# one\n#two\n#\nversion=1\n"));
        assert!(vmdk(b"   \n \r\n# c\nversion=1\n"));
        // Not descriptors: an empty line, indentation, another version, no line end.
        assert!(!vmdk(b"\nversion=1\n"));
        assert!(!vmdk(b"\r\nversion=1\n"));
        assert!(!vmdk(b" version=1\n"));
        assert!(!vmdk(b"version=4\n"));
        assert!(!vmdk(b"version=1 \n"));
        assert!(!vmdk(b"version=1"));
        assert!(!vmdk(b"# no newline, then zeroes"));
        assert!(!vmdk(&[b' '; 512]));
    }

    #[test]
    fn dmg_by_name_only() {
        let dmg = |n: &str| probe(&[0; 512], Some(Path::new(n)));
        assert_eq!(dmg("/srv/x.dmg"), Probed::Other("dmg"));
        assert_eq!(dmg(".dmg"), Probed::Raw);
        assert_eq!(dmg("x.DMG"), Probed::Raw);
        assert_eq!(
            probe(b"QFI\xfb\0\0\0\x03", Some(Path::new("x.dmg"))),
            Probed::Qcow2,
            "qcow2 scores more"
        );
    }
}
