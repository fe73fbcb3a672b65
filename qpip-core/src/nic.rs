//! The NIC an application opens: the backend is chosen here, above the backends.

use std::sync::Arc;

use qpip_lanai::LanaiConfig;
use qpip_soft::SoftConfig;
use qpip_verbs::backend::NicBackend;
use qpip_verbs::{MemoryTable, Result};

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
}

/// Every verb (`alloc_region`, `create_cq`, `create_qp`, `listen`, ...) is the verbs NIC's
/// own: this facade adds only the choice of backend.
impl std::ops::Deref for Nic {
    type Target = qpip_verbs::Nic;

    fn deref(&self) -> &qpip_verbs::Nic {
        &self.0
    }
}
