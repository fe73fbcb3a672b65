//! qpip-nbd-mount: an NBD export (over Queue Pair IP) as one regular file in a FUSE mount.
//!
//! [`export::Export`] is the export behind the file (an [`nbd_client::Pool`] of connections);
//! [`fs::NbdFs`] answers FUSE requests (a directory with one file); `proto` parses them
//! (with `abi`, the kernel's structs); [`session`] runs a connection over one of two
//! transports, `ring` (FUSE over io_uring) or `dev` (/dev/fuse); [`mount`] mounts and
//! [`mountpoint`] checks where the mount goes and unmounts it.

pub(crate) mod abi;
pub(crate) mod dev;
pub mod export;
pub mod fs;
pub mod mount;
pub mod mountpoint;
pub(crate) mod proto;
pub(crate) mod ring;
pub mod session;

/// The file's name in the mount point: the export's name (`nbd` when it is empty), with `/`
/// (not allowed in a file name) replaced by `_`.
pub fn file_name(export: &str) -> String {
    if export.is_empty() {
        "nbd".to_string()
    } else {
        export.replace('/', "_")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn file_names() {
        assert_eq!(super::file_name(""), "nbd");
        assert_eq!(super::file_name("disk"), "disk");
        assert_eq!(super::file_name("vm/disk0"), "vm_disk0");
    }
}
