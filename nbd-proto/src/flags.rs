//! Typed flag sets for every flags field of the protocol.

use crate::consts as c;
use core::fmt;

macro_rules! flag_set {
    (
        $(#[$meta:meta])*
        $name:ident($int:ty) {
            $( $(#[$fmeta:meta])* $flag:ident = $value:expr; )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
        pub struct $name(pub $int);

        impl $name {
            $( $(#[$fmeta])* pub const $flag: Self = Self($value); )*
            /// All bits this crate knows about.
            pub const KNOWN: Self = Self(0 $(| $value)*);

            /// No flag set.
            pub const fn empty() -> Self {
                Self(0)
            }
            /// The raw wire value.
            pub const fn bits(self) -> $int {
                self.0
            }
            /// True if every bit of `other` is set in `self`.
            pub const fn contains(self, other: Self) -> bool {
                self.0 & other.0 == other.0
            }
            /// True if any bit of `other` is set in `self`.
            pub const fn intersects(self, other: Self) -> bool {
                self.0 & other.0 != 0
            }
            /// Bits set in `self` that this crate does not know.
            pub const fn unknown_bits(self) -> $int {
                self.0 & !Self::KNOWN.0
            }
            /// Set or clear `other`.
            pub fn set(&mut self, other: Self, on: bool) {
                if on {
                    self.0 |= other.0;
                } else {
                    self.0 &= !other.0;
                }
            }
            /// `self` with `other` set or cleared.
            #[must_use]
            pub fn with(mut self, other: Self, on: bool) -> Self {
                self.set(other, on);
                self
            }
        }

        impl core::ops::BitOr for $name {
            type Output = Self;
            fn bitor(self, rhs: Self) -> Self {
                Self(self.0 | rhs.0)
            }
        }

        impl core::ops::BitOrAssign for $name {
            fn bitor_assign(&mut self, rhs: Self) {
                self.0 |= rhs.0;
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}(", stringify!($name))?;
                let mut first = true;
                $(
                    if self.contains(Self::$flag) && $value != 0 {
                        if !first { f.write_str(" | ")?; }
                        f.write_str(stringify!($flag))?;
                        first = false;
                    }
                )*
                let unknown = self.unknown_bits();
                if unknown != 0 {
                    if !first { f.write_str(" | ")?; }
                    write!(f, "{:#x}", unknown)?;
                }
                f.write_str(")")
            }
        }
    };
}

flag_set! {
    /// Handshake flags sent by the server in the greeting (16 bits).
    HandshakeFlags(u16) {
        /// `NBD_FLAG_FIXED_NEWSTYLE`.
        FIXED_NEWSTYLE = c::FLAG_FIXED_NEWSTYLE;
        /// `NBD_FLAG_NO_ZEROES`.
        NO_ZEROES = c::FLAG_NO_ZEROES;
    }
}

flag_set! {
    /// Client flags sent in reply to the greeting (32 bits).
    ClientFlags(u32) {
        /// `NBD_FLAG_C_FIXED_NEWSTYLE`.
        FIXED_NEWSTYLE = c::FLAG_C_FIXED_NEWSTYLE;
        /// `NBD_FLAG_C_NO_ZEROES`.
        NO_ZEROES = c::FLAG_C_NO_ZEROES;
    }
}

flag_set! {
    /// Transmission flags describing an export (16 bits).
    TransmissionFlags(u16) {
        /// `NBD_FLAG_HAS_FLAGS`.
        HAS_FLAGS = c::FLAG_HAS_FLAGS;
        /// `NBD_FLAG_READ_ONLY`.
        READ_ONLY = c::FLAG_READ_ONLY;
        /// `NBD_FLAG_SEND_FLUSH`.
        SEND_FLUSH = c::FLAG_SEND_FLUSH;
        /// `NBD_FLAG_SEND_FUA`.
        SEND_FUA = c::FLAG_SEND_FUA;
        /// `NBD_FLAG_ROTATIONAL`.
        ROTATIONAL = c::FLAG_ROTATIONAL;
        /// `NBD_FLAG_SEND_TRIM`.
        SEND_TRIM = c::FLAG_SEND_TRIM;
        /// `NBD_FLAG_SEND_WRITE_ZEROES`.
        SEND_WRITE_ZEROES = c::FLAG_SEND_WRITE_ZEROES;
        /// `NBD_FLAG_SEND_DF`.
        SEND_DF = c::FLAG_SEND_DF;
        /// `NBD_FLAG_CAN_MULTI_CONN`.
        CAN_MULTI_CONN = c::FLAG_CAN_MULTI_CONN;
        /// `NBD_FLAG_SEND_RESIZE`.
        SEND_RESIZE = c::FLAG_SEND_RESIZE;
        /// `NBD_FLAG_SEND_CACHE`.
        SEND_CACHE = c::FLAG_SEND_CACHE;
        /// `NBD_FLAG_SEND_FAST_ZERO`.
        SEND_FAST_ZERO = c::FLAG_SEND_FAST_ZERO;
        /// `NBD_FLAG_BLOCK_STATUS_PAYLOAD`.
        BLOCK_STATUS_PAYLOAD = c::FLAG_BLOCK_STATUS_PAYLOAD;
    }
}

flag_set! {
    /// Command flags of a request (16 bits).
    CmdFlags(u16) {
        /// `NBD_CMD_FLAG_FUA`.
        FUA = c::CMD_FLAG_FUA;
        /// `NBD_CMD_FLAG_NO_HOLE`.
        NO_HOLE = c::CMD_FLAG_NO_HOLE;
        /// `NBD_CMD_FLAG_DF`.
        DF = c::CMD_FLAG_DF;
        /// `NBD_CMD_FLAG_REQ_ONE`.
        REQ_ONE = c::CMD_FLAG_REQ_ONE;
        /// `NBD_CMD_FLAG_FAST_ZERO`.
        FAST_ZERO = c::CMD_FLAG_FAST_ZERO;
        /// `NBD_CMD_FLAG_PAYLOAD_LEN` (extended headers only).
        PAYLOAD_LEN = c::CMD_FLAG_PAYLOAD_LEN;
    }
}

flag_set! {
    /// Structured reply chunk flags (16 bits).
    ReplyFlags(u16) {
        /// `NBD_REPLY_FLAG_DONE`.
        DONE = c::REPLY_FLAG_DONE;
    }
}

flag_set! {
    /// `base:allocation` extent status flags (32 bits).
    AllocationFlags(u32) {
        /// `NBD_STATE_HOLE`.
        HOLE = c::STATE_HOLE;
        /// `NBD_STATE_ZERO`.
        ZERO = c::STATE_ZERO;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flag_ops_and_debug() {
        let f = TransmissionFlags::HAS_FLAGS | TransmissionFlags::READ_ONLY;
        assert_eq!(f.bits(), 3);
        assert!(f.contains(TransmissionFlags::READ_ONLY));
        assert!(!f.contains(TransmissionFlags::SEND_FUA));
        assert_eq!(format!("{f:?}"), "TransmissionFlags(HAS_FLAGS | READ_ONLY)");
        let u = CmdFlags(0x8001);
        assert_eq!(u.unknown_bits(), 0x8000);
        assert_eq!(format!("{u:?}"), "CmdFlags(FUA | 0x8000)");
        let mut g = ClientFlags::empty();
        g.set(ClientFlags::NO_ZEROES, true);
        assert_eq!(g.bits(), 2);
        assert_eq!(g.with(ClientFlags::NO_ZEROES, false), ClientFlags::empty());
        assert_eq!(TransmissionFlags::KNOWN.bits(), 0x1fff);
        assert_eq!(CmdFlags::KNOWN.bits(), 0x3f);
    }
}
