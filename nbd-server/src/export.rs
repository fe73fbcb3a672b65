//! An export: a named disk the server offers (any [`Backend`]), with its registered memory.

use std::sync::Arc;

use nbd_proto::flags::TransmissionFlags;
use qpip_core::{Access, FileRegion, MemoryRegion, Nic};

use crate::backend::Backend;

pub struct Export {
    pub name: String,
    pub description: String,
    /// The store behind the export: a file ([`crate::image::Image`]) or an RBD image.
    pub image: Box<dyn Backend>,
    /// The store's mapping registered with the NIC, so read replies are sent from it (None
    /// for stores without one: qcow2, RBD).
    pub region: Option<MemoryRegion>,
    /// The store's file registered with the NIC for WRITE payloads (raw, writable images).
    pub file_region: Option<FileRegion>,
    /// Writes below this offset are not placed in `file_region` ([`Backend::placement_from`]).
    pub place_from: u64,
}

impl Export {
    pub fn new(
        nic: &Nic,
        name: String,
        description: String,
        image: impl Backend + 'static,
    ) -> Arc<Export> {
        Self::with_backend(nic, name, description, Box::new(image))
    }

    pub fn with_backend(
        nic: &Nic,
        name: String,
        description: String,
        image: Box<dyn Backend>,
    ) -> Arc<Export> {
        let region = image.mapping().map(|(ptr, len)| {
            // SAFETY: the mapping lives as long as the image, which the Export owns; the
            // region is only read by the NIC (Access::READ), and Export outlives every QP's
            // use of it because connections hold an Arc<Export> until their QP is gone.
            unsafe { nic.register_raw(ptr as *mut u8, len, Access::READ, None) }
        });
        let file_region = image
            .placement_file()
            .map(|f| nic.register_file(Arc::new(f), image.size(), Access::READ_WRITE));
        let place_from = image.placement_from();
        Arc::new(Export {
            name,
            description,
            image,
            region,
            file_region,
            place_from,
        })
    }

    pub fn read_only(&self) -> bool {
        self.image.read_only()
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
        }
        f
    }
}
