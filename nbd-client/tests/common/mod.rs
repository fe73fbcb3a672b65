//! The shared helpers nbd-client's tests use, from qpip-test-support (peers and their CI
//! rule, ports, patterns, workspace binaries); nothing here is nbd-client's own.
#![allow(unused_imports)] // each test crate uses a different subset

pub(crate) use qpip_test_support::bins::{qpip_server_bin, workspace_bin};
pub(crate) use qpip_test_support::ci::have;
pub(crate) use qpip_test_support::net::{free_port, wait_port, wait_socket};
pub(crate) use qpip_test_support::pattern::{at_offset as pattern, image_with as image};
pub(crate) use qpip_test_support::servers::{
    Peer, debian_nbd_server, nbdkit, qemu_nbd, qpip_server, qpip_server_on, tcp_peer, tls_certs,
    unix_peer,
};
