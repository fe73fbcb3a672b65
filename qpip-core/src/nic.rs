//! The NIC an application opens: the backend is chosen here, above the backends.

use std::any::Any;
use std::net::SocketAddr;
use std::sync::Arc;

use qpip_lanai::LanaiConfig;
use qpip_soft::SoftConfig;
use qpip_verbs::backend::NicBackend;
use qpip_verbs::{
    Access, CompletionQueue, Listener, MemoryRegion, MemoryTable, QpAttr, QueuePair, Result,
};

/// Which NIC to open.
#[derive(Clone, Debug)]
#[non_exhaustive]
// Built once per NIC: the size of the lanai parameters does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Backend {
    /// The software NIC engine (runs anywhere).
    Soft(SoftConfig),
    /// The QPIP firmware on an emulated LANai 9, frames carried between processes over the
    /// emulated Myrinet fabric (IPv6 only).
    Lanai(LanaiConfig),
}

impl Default for Backend {
    fn default() -> Self {
        Backend::Soft(SoftConfig::default())
    }
}

/// A handle on a NIC. Clones share it; the NIC stops when the last handle, QP and listener
/// are gone.
#[derive(Clone, Debug)]
pub struct Nic(qpip_verbs::Nic);

impl From<qpip_verbs::Nic> for Nic {
    fn from(nic: qpip_verbs::Nic) -> Self {
        Nic(nic)
    }
}

impl Nic {
    /// Opens a NIC on the chosen backend.
    pub fn open(backend: Backend) -> Result<Nic> {
        let memory = MemoryTable::new();
        let backend: Box<dyn NicBackend> = match backend {
            Backend::Soft(cfg) => Box::new(qpip_soft::SoftBackend::start(cfg, memory.clone())?),
            Backend::Lanai(cfg) => Box::new(qpip_lanai::LanaiBackend::start(cfg, memory.clone())?),
        };
        Ok(Self::with_backend(backend, memory))
    }

    /// Opens the software NIC with its default settings.
    pub fn soft() -> Result<Nic> {
        Self::open(Backend::default())
    }

    /// Wraps a backend built elsewhere (it must resolve SGEs through `memory`).
    pub fn with_backend(backend: Box<dyn NicBackend>, memory: Arc<MemoryTable>) -> Nic {
        Nic(qpip_verbs::Nic::with_backend(backend, memory))
    }

    /// The verbs-level handle (what the backends' own code works with).
    pub fn verbs(&self) -> &qpip_verbs::Nic {
        &self.0
    }

    pub fn backend_name(&self) -> &'static str {
        self.0.backend_name()
    }

    /// How the NIC moves data ("io_uring" or "epoll" for the soft NIC).
    pub fn io_path(&self) -> &'static str {
        self.0.io_path()
    }

    /// Kernel thread ids of the NIC engine's threads, for CPU accounting.
    pub fn engine_threads(&self) -> Vec<i32> {
        self.0.engine_threads()
    }

    /// Registers `len` zeroed bytes, allocated and owned by the region.
    pub fn alloc_region(&self, len: usize, access: Access) -> MemoryRegion {
        self.0.alloc_region(len, access)
    }

    /// Registers memory the caller owns (an mmap of a disk image, say).
    ///
    /// # Safety
    /// As for [`qpip_verbs::Nic::register_raw`]: the memory outlives every region and WR
    /// naming it.
    pub unsafe fn register_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        access: Access,
        keep_alive: Option<Box<dyn Any + Send + Sync>>,
    ) -> MemoryRegion {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.0.register_raw(ptr, len, access, keep_alive) }
    }

    /// Creates a completion queue holding up to `depth` completions.
    pub fn create_cq(&self, depth: usize) -> CompletionQueue {
        self.0.create_cq(depth)
    }

    /// Creates a reliable (TCP) QP, idle until it is connected or accepted.
    pub fn create_qp(&self, attr: QpAttr) -> QueuePair {
        self.0.create_qp(attr)
    }

    /// Creates an unreliable (UDP) QP bound to `addr` (port 0 picks one). Every send WR names
    /// its destination; every receive completion reports its source.
    pub fn create_udp_qp(&self, addr: SocketAddr, attr: QpAttr) -> Result<QueuePair> {
        self.0.create_udp_qp(addr, attr)
    }

    /// Listens for TCP connections on `addr`; incoming connections wait until a QP accepts
    /// them.
    pub fn listen(&self, addr: SocketAddr) -> Result<Listener> {
        self.0.listen(addr)
    }
}
