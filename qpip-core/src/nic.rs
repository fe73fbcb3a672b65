//! The NIC an application opens: the choice of NIC ([`NicChoice`]: soft or LANai) is made
//! here, above the backends that implement it.

use std::sync::Arc;

use qpip_lanai::LanaiConfig;
use qpip_soft::SoftConfig;
use qpip_verbs::backend::NicBackend;
use qpip_verbs::{MemoryTable, Result};

/// Which NIC to open, with its settings: the software NIC or the LANai. (The trait each
/// of them implements is qpip-verbs' `NicBackend`.)
#[derive(Clone, Debug)]
#[non_exhaustive]
// Built once per NIC: the size of the lanai parameters does not matter.
#[allow(clippy::large_enum_variant)]
pub enum NicChoice {
    /// The software NIC engine (runs anywhere).
    Soft(SoftConfig),
    /// The QPIP firmware on an emulated LANai 9, frames carried between processes over the
    /// emulated Myrinet fabric (IPv6 only).
    Lanai(LanaiConfig),
}

impl Default for NicChoice {
    fn default() -> Self {
        NicChoice::Soft(SoftConfig::default())
    }
}

/// A handle on a NIC. Clones share it, and so does every QP and listener: the NIC goes away
/// (its threads joined, every descriptor it opened closed) when the last handle, QP and
/// listener are gone; see `qpip_verbs::Nic`.
#[derive(Clone, Debug)]
pub struct Nic(qpip_verbs::Nic);

impl Nic {
    /// Opens the chosen NIC.
    pub fn open(choice: NicChoice) -> Result<Nic> {
        let memory = MemoryTable::new();
        let backend: Box<dyn NicBackend> = match choice {
            NicChoice::Soft(cfg) => Box::new(qpip_soft::SoftBackend::start(cfg, memory.clone())?),
            NicChoice::Lanai(cfg) => {
                Box::new(qpip_lanai::LanaiBackend::start(cfg, memory.clone())?)
            }
        };
        Ok(Self::with_backend(backend, memory))
    }

    /// Opens the software NIC with its default settings.
    pub fn soft() -> Result<Nic> {
        Self::open(NicChoice::default())
    }

    /// Wraps a backend built elsewhere (it must resolve SGEs through `memory`).
    pub fn with_backend(backend: Box<dyn NicBackend>, memory: Arc<MemoryTable>) -> Nic {
        Nic(qpip_verbs::Nic::with_backend(backend, memory))
    }
}

/// Every verb (`alloc_region`, `create_cq`, `create_qp`, `listen`, ...) is the verbs NIC's
/// own: this facade adds only the choice of NIC. Applications name only this `Nic`: the
/// verbs-level one inside it is not re-exported, and no accessor hands it out.
impl std::ops::Deref for Nic {
    type Target = qpip_verbs::Nic;

    fn deref(&self) -> &qpip_verbs::Nic {
        &self.0
    }
}
