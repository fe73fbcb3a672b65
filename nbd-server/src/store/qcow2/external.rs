//! What lies beside a qcow2 image file: its backing file (what unallocated clusters read)
//! and its external data file (where data clusters are).

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use std::os::unix::fs::FileExt;

use zeroize::Zeroizing;

use super::luks::SECTOR;
use super::write::zero_file;
use super::{Qcow2, read_some, unsupported};
use crate::store::Store;

impl Qcow2 {
    /// The backing file's name as the header has it (resolved by `store::open`, as qemu
    /// resolves it: a relative name against the directory of this image's path as given),
    /// and its format if the header names one. A name with a protocol (`nbd:...`,
    /// `json:...`) is refused.
    pub fn backing_name(&self) -> io::Result<Option<(&str, Option<&str>)>> {
        let Some(name) = self.names.backing.as_deref() else {
            return Ok(None);
        };
        if name.is_empty() {
            return Err(unsupported("has an empty backing file name"));
        }
        // qemu's path_has_protocol: a colon before any slash.
        if name
            .split('/')
            .next()
            .is_some_and(|head| head.contains(':'))
        {
            return Err(unsupported(format!(
                "has backing file {name:?}, which names a protocol: not supported"
            )));
        }
        Ok(Some((name, self.names.backing_format.as_deref())))
    }

    /// The external data file's name as the header has it (resolved by `store::open`
    /// against this image's directory).
    pub fn data_file_name(&self) -> Option<&str> {
        self.names.data_file.as_deref()
    }

    /// Where a name this image holds points, for messages: beside this image's path as
    /// given, or the name itself when it is absolute.
    pub fn beside(&self, name: &str) -> PathBuf {
        match self.path.parent() {
            Some(dir) if !Path::new(name).is_absolute() => dir.join(name),
            _ => PathBuf::from(name),
        }
    }

    /// Attaches the external data file (opened writable unless the image is read-only).
    pub fn set_data_file(&mut self, data: File) {
        self.data = Some(data);
    }

    /// The file data clusters are in.
    pub(super) fn data(&self) -> &File {
        self.data.as_ref().unwrap_or(&self.file)
    }

    /// Attaches the backing file (opened read-only): what unallocated clusters read.
    pub fn set_backing(&mut self, backing: Box<dyn Store>) {
        self.backing = Some(backing);
    }

    /// Fills `out` with the backing file's bytes from guest offset `at`: zeroes past its end,
    /// or without one.
    pub(super) fn read_backing(&self, out: &mut [u8], at: u64) -> io::Result<()> {
        let Some(backing) = &self.backing else {
            out.fill(0);
            return Ok(());
        };
        let has = backing.size().saturating_sub(at).min(out.len() as u64) as usize;
        if has > 0 {
            backing.read_at(&mut out[..has], at)?;
        }
        out[has..].fill(0);
        Ok(())
    }

    /// Reads data cluster bytes at host offset `at`: zeroes past the end of the file that
    /// holds them (qemu reads a truncated image's clusters so, and creates an external data
    /// file sparse that another tool may have left short). In an encrypted image, the
    /// sectors they lie in are read and decrypted.
    pub(super) fn read_data(&self, out: &mut [u8], at: u64) -> io::Result<()> {
        let Some(crypt) = &self.crypt else {
            return read_zero_filled(self.data(), out, at);
        };
        let (start, end) = sectors(at, out.len());
        let mut whole = Zeroizing::new(vec![0u8; (end - start) as usize]);
        read_zero_filled(self.data(), &mut whole, start)?;
        crypt.decrypt(&mut whole, start / SECTOR);
        let skip = (at - start) as usize;
        out.copy_from_slice(&whole[skip..skip + out.len()]);
        Ok(())
    }

    /// Writes data cluster bytes at host offset `at`. In an encrypted image the sectors
    /// they lie in are encrypted and written, the bytes around them read first where the
    /// data does not cover a whole sector.
    pub(super) fn write_data(&self, data: &[u8], at: u64) -> io::Result<()> {
        let Some(crypt) = &self.crypt else {
            return self.data().write_all_at(data, at);
        };
        let (start, end) = sectors(at, data.len());
        let mut whole = Zeroizing::new(vec![0u8; (end - start) as usize]);
        let skip = (at - start) as usize;
        if skip != 0 || whole.len() != data.len() {
            self.read_data(&mut whole, start)?;
        }
        whole[skip..skip + data.len()].copy_from_slice(data);
        crypt.encrypt(&mut whole, start / SECTOR);
        self.data().write_all_at(&whole, start)
    }

    /// Zeroes `[at, at + len)` of the raw external data file.
    pub(super) fn zero_data(&self, at: u64, len: u64) -> io::Result<()> {
        zero_file(self.data(), at, len)
    }
}

/// Reads `out.len()` bytes of `file` at `at`, zeroes past its end.
fn read_zero_filled(file: &File, out: &mut [u8], at: u64) -> io::Result<()> {
    let n = read_some(file, out, at)?;
    out[n..].fill(0);
    Ok(())
}

/// The whole sectors `[start, end)` that `len` bytes at `at` lie in.
fn sectors(at: u64, len: usize) -> (u64, u64) {
    let start = at / SECTOR * SECTOR;
    (start, (at + len as u64).div_ceil(SECTOR) * SECTOR)
}
