//! The rig the NBD experiments stand on, one kind a module: the work directory and its images,
//! the peer servers, the mounts of `nbd ext2`, fio as a client, and the network namespace of
//! `--netns`.

pub(crate) mod fio;
pub(crate) mod mount;
pub(crate) mod netns;
pub(crate) mod peers;
pub(crate) mod workdir;

use std::path::PathBuf;

/// Where `prog` is in PATH, if anywhere (the rig's prerequisites: peers, `ip`, `rbd`).
pub(crate) fn in_path(prog: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(prog))
        .find(|p| p.is_file())
}
