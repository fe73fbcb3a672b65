//! What the workspace's integration tests share, so that each crate's `tests/common` keeps
//! only what is its own: free ports and waiting for listeners ([`net`]), deterministic test
//! data ([`pattern`]), finding peer programs under one CI rule ([`ci`]), building and
//! locating the workspace's binaries with the run's features ([`bins`]), running peer
//! commands with a time limit ([`process`]), peer servers as child processes that die
//! with their guard ([`servers`]), the honest handshake of hand-made fake servers
//! ([`fake`]), and a second host across a veth link ([`netns`]).
//!
//! # The CI rule
//!
//! With the environment variable `CI` set to `true` or `1` (as CI systems set it), a missing
//! prerequisite of a test (a peer program, root, /dev/fuse, a kernel feature) is a failure:
//! the test panics naming it. Without it, the test is skipped: it prints a note naming what
//! is missing on stderr and returns. Every test decides through [`ci::missing`] (or the
//! helpers built on it: [`ci::have`], [`ci::require`]), never by reading `CI` itself.

pub mod bins;
pub mod ci;
pub mod fake;
pub mod net;
pub mod netns;
pub mod pattern;
pub mod process;
pub mod servers;
