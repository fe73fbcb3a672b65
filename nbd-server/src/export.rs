//! An export: a named disk the server offers (any [`Store`]), with its registered memory.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use nbd_proto::flags::TransmissionFlags;
use qpip_core::{Access, FileRegion, MemoryRegion, Nic};

use crate::metrics::ExportStats;
use crate::store::Store;

/// A metadata context an export offers besides `base:allocation`, which every export offers.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MetaContext {
    /// `qemu:allocation-depth` (qemu-nbd's `-A`): which layer of the backing chain holds
    /// each extent ([`Store::allocation_depth`]).
    AllocationDepth,
    /// `qemu:dirty-bitmap:NAME` (qemu-nbd's `-B NAME`): the persistent dirty bitmap NAME,
    /// flag 1 for dirty ([`Store::dirty_bitmap`]).
    DirtyBitmap(String),
}

impl MetaContext {
    /// The context's name, as clients ask for it.
    pub fn name(&self) -> String {
        match self {
            MetaContext::AllocationDepth => nbd_proto::consts::QEMU_ALLOCATION_DEPTH.to_owned(),
            MetaContext::DirtyBitmap(b) => format!("{}{b}", nbd_proto::consts::QEMU_DIRTY_BITMAP),
        }
    }
}

/// An export: a store served under a name, with its memory registered with the NIC.
pub struct Export {
    /// The export's name, as clients ask for it.
    pub name: String,
    /// Its description (NBD_INFO_DESCRIPTION), possibly empty.
    pub description: String,
    /// The store behind the export (opened by [`crate::store::open`]).
    pub store: Box<dyn Store>,
    /// The store's mapping registered with the NIC, so read replies are sent from it (None
    /// for stores without one: qcow2, RBD).
    pub region: Option<MemoryRegion>,
    /// The store's file registered with the NIC for WRITE payloads (raw, writable images).
    pub file_region: Option<FileRegion>,
    /// Writes below this offset are not placed in `file_region` ([`Store::placement_from`]).
    pub place_from: u64,
    /// Connections in their transmission phase on this export (a RESIZE that shrinks it is
    /// refused while others are open).
    pub connections: AtomicUsize,
    /// What its connections did ([`crate::metrics`]).
    pub stats: ExportStats,
    /// The metadata contexts offered besides `base:allocation`, in the order they are listed.
    pub contexts: Vec<MetaContext>,
}

impl Export {
    /// The context called `name`, if the export offers it.
    pub fn context(&self, name: &str) -> Option<&MetaContext> {
        self.contexts.iter().find(|c| c.name() == name)
    }

    /// `store` served as `name`, its mapping and file registered with `nic` where it has them,
    /// offering `contexts` besides `base:allocation`.
    pub fn new(
        nic: &Nic,
        name: String,
        description: String,
        store: Box<dyn Store>,
        contexts: Vec<MetaContext>,
    ) -> Arc<Export> {
        let region = store.mapping().map(|(ptr, len)| {
            // SAFETY: the mapping lives as long as the store, which the Export owns; the
            // region is only read by the NIC (Access::READ), and Export outlives every QP's
            // use of it because connections hold an Arc<Export> until their QP is gone.
            unsafe { nic.register_raw(ptr as *mut u8, len, Access::READ, None) }
        });
        let file_region = store
            .placement_file()
            .map(|f| nic.register_file(Arc::new(f), store.size(), Access::READ_WRITE));
        let place_from = store.placement_from();
        Arc::new(Export {
            name,
            description,
            store,
            region,
            file_region,
            place_from,
            connections: AtomicUsize::new(0),
            stats: ExportStats::default(),
            contexts,
        })
    }

    /// Writes are refused.
    pub fn read_only(&self) -> bool {
        self.store.read_only()
    }

    /// What this export can do, as NBD transmission flags. Every connection writes through
    /// the same store (one file, or one open RBD image) and FLUSH flushes all of it, so a flush on one connection covers writes
    /// completed on all of them: multi-conn is true.
    pub fn flags(&self) -> TransmissionFlags {
        let mut f = TransmissionFlags::HAS_FLAGS
            | TransmissionFlags::SEND_FLUSH
            | TransmissionFlags::SEND_FUA
            | TransmissionFlags::SEND_CACHE
            | TransmissionFlags::CAN_MULTI_CONN
            | TransmissionFlags::SEND_DF;
        if self.read_only() {
            f |= TransmissionFlags::READ_ONLY;
        } else {
            f |= TransmissionFlags::SEND_TRIM
                | TransmissionFlags::SEND_WRITE_ZEROES
                | TransmissionFlags::SEND_FAST_ZERO;
            // NBD's experimental RESIZE: where the store can change its size (RBD).
            if self.store.can_resize() {
                f |= TransmissionFlags::SEND_RESIZE;
            }
        }
        f
    }
}
