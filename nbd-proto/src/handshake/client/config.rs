//! The client's configuration: which export, and which options it asks the server for.

/// Client configuration for connecting to / querying an export.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    /// Export name ("" = default export).
    pub export_name: String,
    /// Ask for structured replies.
    pub structured_replies: bool,
    /// Ask for extended headers first (only with `use_go`, as the spec requires).
    pub extended_headers: bool,
    /// Ask for the `base:allocation` metadata context (needs structured replies).
    pub base_allocation: bool,
    /// Further metadata contexts to select, by name (e.g. `qemu:allocation-depth`), in the
    /// same `NBD_OPT_SET_META_CONTEXT` (needs structured replies).
    pub meta_contexts: Vec<String>,
    /// List the export's metadata contexts first (`NBD_OPT_LIST_META_CONTEXT` with no
    /// query: every one it offers), reported in [`super::ClientNegotiated::listed_contexts`].
    pub list_contexts: bool,
    /// Use `NBD_FLAG_C_NO_ZEROES` if the server offers it.
    pub no_zeroes: bool,
    /// Use `NBD_OPT_GO` (else go straight to `NBD_OPT_EXPORT_NAME`).
    pub use_go: bool,
    /// Largest option reply accepted (bounded memory).
    pub max_option_reply_len: u32,
    /// Upgrade to TLS with `NBD_OPT_STARTTLS` before anything else, and fail rather than
    /// go on without it.
    pub tls: bool,
}

impl ClientConfig {
    /// Everything enabled for `export_name`.
    pub fn new(export_name: impl Into<String>) -> Self {
        Self {
            export_name: export_name.into(),
            structured_replies: true,
            extended_headers: true,
            base_allocation: true,
            meta_contexts: Vec::new(),
            list_contexts: false,
            no_zeroes: true,
            use_go: true,
            max_option_reply_len: crate::framing::DEFAULT_MAX_OPTION_LEN,
            tls: false,
        }
    }
}
