//! The server's configuration: its exports and how it treats TLS, options and limits.

use crate::flags::TransmissionFlags;
use crate::handshake::messages::BlockSize;

/// Description of one export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Export {
    /// Name (at most 4096 bytes; "" may be used for the default export).
    pub name: String,
    /// Human-readable description (sent in `NBD_REP_SERVER` and `NBD_INFO_DESCRIPTION`).
    pub description: String,
    /// Size in bytes.
    pub size: u64,
    /// Advertised transmission flags: `READ_ONLY`, `SEND_FLUSH`, `SEND_FUA`,
    /// `ROTATIONAL`, `SEND_TRIM`, `SEND_WRITE_ZEROES`, `SEND_DF`, `CAN_MULTI_CONN`,
    /// `SEND_CACHE`, `SEND_FAST_ZERO`... `HAS_FLAGS` is always added; `SEND_DF`
    /// is dropped unless structured replies were negotiated and `SEND_FAST_ZERO`
    /// unless `SEND_WRITE_ZEROES` is set, as the spec requires.
    pub flags: TransmissionFlags,
    /// Block size constraints; `None` means the spec defaults (1 / 4096 / unlimited).
    pub block_size: Option<BlockSize>,
    /// Refuse clients that do not acknowledge `block_size` (`NBD_OPT_GO` without an
    /// `NBD_INFO_BLOCK_SIZE` request gets `NBD_REP_ERR_BLOCK_SIZE_REQD`;
    /// `NBD_OPT_EXPORT_NAME` gets a hard disconnect).
    pub require_block_size: bool,
    /// Metadata contexts offered besides `base:allocation` (e.g.
    /// [`crate::consts::QEMU_ALLOCATION_DEPTH`]), in the order they are listed; the caller
    /// answers `BLOCK_STATUS` for them.
    pub contexts: Vec<String>,
}

impl Export {
    /// A writable export with no optional features.
    pub fn new(name: impl Into<String>, size: u64) -> Self {
        Self {
            name: name.into(),
            description: String::new(),
            size,
            flags: TransmissionFlags::empty(),
            block_size: None,
            require_block_size: false,
            contexts: Vec::new(),
        }
    }

    /// The flags actually sent, given whether structured replies were negotiated.
    pub fn transmission_flags(&self, structured_replies: bool) -> TransmissionFlags {
        let mut f = TransmissionFlags(self.flags.bits() & TransmissionFlags::KNOWN.bits())
            | TransmissionFlags::HAS_FLAGS;
        if !structured_replies {
            f.set(TransmissionFlags::SEND_DF, false);
        }
        if !f.contains(TransmissionFlags::SEND_WRITE_ZEROES) {
            f.set(TransmissionFlags::SEND_FAST_ZERO, false);
        }
        f
    }

    /// The metadata contexts offered, with the ids `NBD_OPT_SET_META_CONTEXT` gives them, as
    /// qemu-nbd numbers them: `base:allocation` ([`super::BASE_ALLOCATION_ID`], 0), then
    /// [`Self::contexts`] in order, `qemu:allocation-depth` 1 and the others 2 on.
    pub fn offered_contexts(&self) -> impl Iterator<Item = (u32, &str)> {
        use crate::consts::{BASE_ALLOCATION, QEMU_ALLOCATION_DEPTH};
        let mut next = super::BASE_ALLOCATION_ID + 2;
        core::iter::once(BASE_ALLOCATION)
            .chain(self.contexts.iter().map(String::as_str))
            .map(move |name| {
                let id = match name {
                    BASE_ALLOCATION => super::BASE_ALLOCATION_ID,
                    QEMU_ALLOCATION_DEPTH => super::BASE_ALLOCATION_ID + 1,
                    _ => {
                        next += 1;
                        next - 1
                    }
                };
                (id, name)
            })
    }

    pub(super) fn effective_block_size(&self) -> BlockSize {
        self.block_size.unwrap_or(BlockSize::DEFAULT)
    }
}

/// How the server treats TLS (nbdkit's `--tls` meanings).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// No TLS: `NBD_OPT_STARTTLS` gets `NBD_REP_ERR_UNSUP`.
    #[default]
    Off,
    /// TLS offered: a client may upgrade with `NBD_OPT_STARTTLS`, or stay in plaintext.
    On,
    /// TLS required: every option before `NBD_OPT_STARTTLS` (but `NBD_OPT_ABORT`) gets
    /// `NBD_REP_ERR_TLS_REQD`, and `NBD_OPT_EXPORT_NAME` a hard disconnect.
    Require,
}

/// Server configuration. The `support_*` knobs exist mostly to emulate older
/// servers (for interoperability tests of clients' fallbacks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Exports, looked up by exact name.
    pub exports: Vec<Export>,
    /// Name of the export served for the empty name, if no export is named "".
    pub default_export: Option<String>,
    /// Advertise `NBD_FLAG_NO_ZEROES`.
    pub offer_no_zeroes: bool,
    /// Accept clients that do not set `NBD_FLAG_C_FIXED_NEWSTYLE` (they may then
    /// only send `NBD_OPT_EXPORT_NAME`).
    pub allow_non_fixed_newstyle: bool,
    /// Answer `NBD_OPT_LIST` (else `NBD_REP_ERR_POLICY`).
    pub allow_list: bool,
    /// Support `NBD_OPT_INFO` / `NBD_OPT_GO` (else `NBD_REP_ERR_UNSUP`).
    pub support_go: bool,
    /// Support `NBD_OPT_STRUCTURED_REPLY` (else `NBD_REP_ERR_UNSUP`).
    pub support_structured_replies: bool,
    /// Support `NBD_OPT_EXTENDED_HEADERS` (else `NBD_REP_ERR_UNSUP`; also without `support_go`).
    pub support_extended_headers: bool,
    /// Support metadata contexts (`base:allocation` and each export's
    /// [`Export::contexts`]) via the meta context options (else `NBD_REP_ERR_UNSUP`).
    pub support_meta_contexts: bool,
    /// TLS: off, offered, or required. The caller performs the TLS handshake on
    /// [`super::ServerEvent::StartTls`].
    pub tls: TlsMode,
    /// Option data larger than this is a hard disconnect (bounded memory).
    pub max_option_len: u32,
    /// More options than this in one handshake is treated as denial of service
    /// (hard disconnect).
    pub max_options: u32,
}

/// Default [`ServerConfig::max_options`].
pub const DEFAULT_MAX_OPTIONS: u32 = 1024;

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            exports: Vec::new(),
            default_export: None,
            offer_no_zeroes: true,
            allow_non_fixed_newstyle: true,
            allow_list: true,
            support_go: true,
            support_structured_replies: true,
            support_extended_headers: true,
            support_meta_contexts: true,
            tls: TlsMode::Off,
            max_option_len: crate::framing::DEFAULT_MAX_OPTION_LEN,
            max_options: DEFAULT_MAX_OPTIONS,
        }
    }
}

impl ServerConfig {
    /// A default configuration serving `exports`.
    pub fn new(exports: Vec<Export>) -> Self {
        Self {
            exports,
            ..Self::default()
        }
    }

    pub(super) fn lookup(&self, name: &str) -> Option<usize> {
        if let Some(i) = self.exports.iter().position(|e| e.name == name) {
            return Some(i);
        }
        if name.is_empty() {
            let d = self.default_export.as_deref()?;
            return self.exports.iter().position(|e| e.name == d);
        }
        None
    }
}
