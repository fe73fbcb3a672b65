//! The format probe: what an image file's first bytes say it is, as qemu probes them.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// The magic a qcow2 image starts with.
pub const QCOW2_MAGIC: &[u8; 4] = b"QFI\xfb";

/// How many of an image's first bytes the format probe reads, and so how many a probed raw
/// image's guest may not turn into another format's header.
pub const HEAD: u64 = 512;

/// What the first bytes of an image say it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probed {
    /// A raw image (no header of a known format).
    Raw,
    /// A qcow2 image.
    Qcow2,
    /// A format this server does not serve, by its usual name.
    Other(&'static str),
}

/// Probes a file's format from its first bytes, as qemu does: qcow2 by its magic, the
/// formats we do not serve by theirs, anything else raw.
pub fn probe(head: &[u8]) -> Probed {
    let at = |off: usize, magic: &[u8]| head.get(off..off + magic.len()) == Some(magic);
    if at(0, QCOW2_MAGIC) {
        return if head.len() >= 8 && head[4..8] == [0, 0, 0, 1] {
            Probed::Other("qcow (version 1)")
        } else {
            Probed::Qcow2
        };
    }
    const OTHERS: &[(usize, &[u8], &str)] = &[
        (0, b"KDMV", "vmdk"),
        (0, b"COWD", "vmdk"),
        (0, b"# Disk DescriptorFile", "vmdk"),
        (64, &[0x7f, 0x10, 0xda, 0xbe], "vdi"),
        (0, b"vhdxfile", "vhdx"),
        (0, b"conectix", "vpc (vhd)"),
        (0, b"QED\0", "qed"),
        (0, b"LUKS\xba\xbe", "luks"),
        (0, b"WithoutFreeSpace", "parallels"),
        (0, b"WithouFreSpacExt", "parallels"),
        (0, b"Bochs Virtual HD Image", "bochs"),
        (0, b"#!/bin/sh\n#V2.0 Format\nmodprobe cloop", "cloop"),
    ];
    for (off, magic, name) in OTHERS {
        if at(*off, magic) {
            return Probed::Other(name);
        }
    }
    Probed::Raw
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
