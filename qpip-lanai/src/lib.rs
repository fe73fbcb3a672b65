//! The lanai backend: the QPIP firmware on an emulated LANai 9 NIC and Myrinet fabric.
//!
//! - [`params`]: the model's inputs (`configs/lanai.toml`, `configs/fabric.toml`);
//! - `meter`: the NIC processor's clock, charging each firmware stage its cost;
//! - [`frame`]: Myrinet frames, source routes and switches;
//! - [`pci`]: the host's PCI bus, shared by both DMA engines and PIO;
//! - `memport`: the NIC's SRAM port, whose cycles the DMA engines take from the processor;
//! - `sram`: the NIC's SRAM as an allocator (QPs, TCBs and socket buffers must fit);
//! - `firmware`: the doorbell, management, transmit and receive state machines with the
//!   firmware's own IPv6/UDP/TCP, sans-IO;
//! - [`sim`]: two hosts, their NICs and the fabric on a virtual clock (discrete events);
//! - `realtime`: the firmware as a working [`qpip_verbs::backend::NicBackend`], frames carried
//!   between processes by datagram sockets, with a TUN bridge to the host's own IP stack.

pub mod bridge;
pub(crate) mod firmware;
pub mod frame;
pub(crate) mod memport;
pub(crate) mod meter;
pub mod params;
pub mod pci;
pub mod realtime;
pub mod sim;
pub(crate) mod sram;

pub use params::{FabricParams, LanaiParams, ParamsError};
pub use realtime::{LanaiBackend, LanaiConfig};
