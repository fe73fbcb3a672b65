//! Compressed clusters (zlib, i.e. raw deflate, and zstd): where one lies and what it
//! decompresses to, one cluster at most.

use std::io;

use super::header::Compression;
use super::{Qcow2, read_some};

impl Qcow2 {
    /// The host range a compressed cluster's entry names: (offset, length in bytes).
    pub(super) fn compressed_range(&self, entry: u64) -> (u64, u64) {
        let shift = 62 - (self.cluster_bits - 8);
        let offset = entry & ((1 << shift) - 1);
        let sectors = ((entry >> shift) & ((1 << (self.cluster_bits - 8)) - 1)) + 1;
        (offset, sectors * 512 - (offset & 511))
    }

    /// The contents of a compressed cluster: exactly one cluster, however the stream is
    /// crafted (at most two clusters of input are read, and output past the cluster is not
    /// made). Like qemu, a stream that fills the cluster is accepted; one that ends short
    /// of it, or is corrupt, is EIO.
    pub(super) fn decompress(&self, entry: u64) -> io::Result<Vec<u8>> {
        let (at, len) = self.compressed_range(entry);
        if self.external {
            return Err(io::Error::other(
                "a compressed cluster in an image with an external data file (qemu makes none)",
            ));
        }
        if self.crypt.is_some() {
            return Err(io::Error::other(
                "a compressed cluster in an encrypted image (qemu makes none)",
            ));
        }
        let mut input = vec![0u8; len as usize];
        // The last compressed cluster may end before its last sector does.
        read_some(&self.file, &mut input, at)?;
        let mut out = vec![0u8; self.cluster_size() as usize];
        let bad = |why: String| {
            io::Error::other(format!(
                "compressed cluster at host offset {at:#x} does not decompress: {why}"
            ))
        };
        match self.compression {
            Compression::Zlib => {
                let mut z = flate2::Decompress::new(false);
                z.decompress(&input, &mut out, flate2::FlushDecompress::Finish)
                    .map_err(|e| bad(e.to_string()))?;
                if z.total_out() != out.len() as u64 {
                    return Err(bad(format!("{} bytes, not a cluster", z.total_out())));
                }
            }
            Compression::Zstd => {
                use zstd::stream::raw::{Decoder, InBuffer, Operation, OutBuffer};
                let mut z = Decoder::new()?;
                let mut inb = InBuffer::around(&input);
                let mut outb = OutBuffer::around(&mut out[..]);
                let mut left = 1;
                while outb.pos() < outb.capacity() {
                    let (was_in, was_out) = (inb.pos(), outb.pos());
                    left = z.run(&mut inb, &mut outb).map_err(|e| bad(e.to_string()))?;
                    if inb.pos() == was_in && outb.pos() == was_out {
                        return Err(bad(format!("{} bytes, not a cluster", outb.pos())));
                    }
                }
                // The frame ends with the cluster (qemu's check): else it held more.
                if left != 0 {
                    return Err(bad("more than a cluster".into()));
                }
            }
        }
        Ok(out)
    }
}
