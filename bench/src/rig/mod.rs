//! The rig the NBD experiments stand on, one kind a module: the work directory and its images,
//! the peer servers, the mounts of `nbd ext2`, fio as a client, and the network namespace of
//! `--netns`.

pub(crate) mod fio;
pub(crate) mod mount;
pub(crate) mod netns;
pub(crate) mod peers;
pub(crate) mod workdir;
