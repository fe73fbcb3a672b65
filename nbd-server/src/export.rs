//! An export: a named image the server offers, with its registered memory.

use std::sync::Arc;

use nbd_proto::flags::TransmissionFlags;
use qpip_core::{Access, MemoryRegion, Nic};

use crate::image::Image;

pub struct Export {
    pub name: String,
    pub description: String,
    pub image: Image,
    /// The image mapping registered with the NIC, so read replies are sent from it.
    pub region: Option<MemoryRegion>,
}

impl Export {
    pub fn new(nic: &Nic, name: String, description: String, image: Image) -> Arc<Export> {
        let region = image.mapping().map(|(ptr, len)| {
            // SAFETY: the mapping lives as long as the image, which the Export owns; the
            // region is only read by the NIC (Access::READ), and Export outlives every QP's
            // use of it because connections hold an Arc<Export> until their QP is gone.
            unsafe { nic.register_raw(ptr as *mut u8, len, Access::READ, None) }
        });
        Arc::new(Export {
            name,
            description,
            image,
            region,
        })
    }

    pub fn read_only(&self) -> bool {
        self.image.read_only()
    }

    /// What this export can do, as NBD transmission flags. Every connection writes through
    /// the same file and FLUSH syncs that file, so a flush on one connection covers writes
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
