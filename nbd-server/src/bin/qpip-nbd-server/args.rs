//! The command line: every option with its help text (most of the binary's words).

use std::path::PathBuf;

use clap::Parser;
use nbd_server::store::EncryptionFormat;
use nbd_server::store::open::Format;
use qpip_cli::NicArgs;
use qpip_cli::logging::LogArgs;
use qpip_cli::refused::Refused;

#[derive(Parser, Debug)]
#[command(
    name = "qpip-nbd-server",
    version,
    about = "Export disk images over NBD, carried by Queue Pair IP",
    long_about = "Export disk images over NBD, carried by Queue Pair IP.\n\n\
        Every connection runs on a QP of the soft NIC (or, with --backend lanai, of the QPIP \
        firmware on an emulated LANai 9 NIC; see docs/lanai.md): requests land in registered receive \
        buffers and read replies of raw images are sent straight from the image's registered \
        mapping (a qcow2 image is served as its virtual disk, through its cluster tables). The \
        wire is plain NBD (fixed newstyle), so any NBD client works.\n\n\
        With no arguments it creates a 64 MiB demo image in memory (gone when the server \
        exits) and serves it as export \"demo\" (also the default export) on [::1]:10809 and 127.0.0.1:10809.",
    after_help = "Socket activation: started by systemd with LISTEN_PID and LISTEN_FDS set, the \
        server serves on the sockets passed to it (from fd 3) instead of listening itself.\n\n\
        Examples:\n  \
        qpip-nbd-server --export disk=/var/lib/images/disk.img\n  \
        qpip-nbd-server --listen 0.0.0.0:10809 --export scratch=/tmp/s.img --create 4G\n  \
        qpip-nbd-server --config /usr/local/share/qpip/server.toml\n  \
        qpip-nbd-server --fork --pid-file /run/qpip.pid -f qcow2 --export vm=vm.qcow2\n  \
        qpip-nbd-server --encryption-passphrase-file pass.txt --export vm=luks.qcow2\n  \
        qpip-nbd-server --export d=disk.img --run 'qemu-img info \"$uri\"'\n  \
        qpip-nbd-server -x disk -D 'the main disk' disk.img   (qemu-nbd's form)\n  \
        qemu-img info nbd://127.0.0.1/disk"
)]
pub(crate) struct Cli {
    /// Address to listen on: ADDR:PORT (IPv6 in brackets), HOST:PORT, HOST (port 10809) or a
    /// bare PORT (the default addresses); repeat for several. Default: [::1]:10809 and
    /// 127.0.0.1:10809; with --backend lanai, the node's fabric address,
    /// [fd00:4c41:4e41::1]:10809 for node "server".
    #[arg(short, long, value_name = "ADDR:PORT")]
    pub listen: Vec<String>,
    /// The port, as qemu-nbd and nbdkit spell it: for every --bind address, or for the
    /// default addresses.
    #[arg(short, long, value_name = "PORT")]
    pub port: Option<u16>,
    /// An address or host name to listen on at --port (default 10809), as qemu-nbd and
    /// nbdkit spell it; repeat for several.
    #[arg(short, long, value_name = "ADDR")]
    pub bind: Vec<String>,
    /// Listen on a Unix-domain socket at PATH (qemu-nbd's -k, nbdkit's --unix), created
    /// readable and writable by the server's user only and removed when the server exits; a
    /// stale socket left there by a dead server is replaced. Clients connect with
    /// nbd+unix:///EXPORT?socket=PATH. Alone, the server listens on no TCP address; add
    /// --listen/--port/--bind for both. The soft NIC only (the LANai reaches its fabric only).
    /// (-U is --force-share, as in qemu-img and qemu-io.)
    #[arg(short = 'k', long, visible_alias = "unix", value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// An export: NAME=PATH of an image file or block device, or NAME=rbd:POOL/IMAGE[@SNAP]
    /// of a Ceph RBD image (see --ceph-conf; a snapshot is served read-only; after `rbd
    /// resize` new connections get the new size, open ones keep theirs and get EINVAL/ENOSPC
    /// past a shrunk end; a writable one offers NBD's experimental RESIZE, `qpip-nbd
    /// resize`); repeat for several.
    #[arg(short, long, value_name = "NAME=PATH")]
    pub export: Vec<String>,
    /// qemu-nbd's form: an image file (or block device, or rbd:POOL/IMAGE) served as one more
    /// export, named by --export-name (default: the empty name, as qemu-nbd's) and made the
    /// default export unless --default-export names another. One FILE only (as qemu-nbd).
    #[arg(value_name = "FILE")]
    pub image: Vec<PathBuf>,
    /// The export name of the positional FILE (qemu-nbd's -x); default "" (the empty name,
    /// which every client gets when it asks for none).
    #[arg(short = 'x', long, value_name = "NAME")]
    pub export_name: Option<String>,
    /// qemu-nbd's -t: accepted and changes nothing. This server always keeps serving after a
    /// client leaves (qemu-nbd without -t exits after its last client); to stop once a job
    /// is done, use --run.
    #[arg(short = 't', long)]
    pub persistent: bool,
    /// A TOML configuration file; flags add to it. An example with every key is installed
    /// as PREFIX/share/qpip/server.toml (configs/server.toml in the source).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The images' format: raw (the file's bytes are the disk) or qcow2 (its virtual disk).
    /// Default: probed from each image's first bytes, as qemu-nbd does; an image in another
    /// format qemu probes (vmdk, vdi, qcow version 1, luks, ...; dmg by its name) is left out
    /// with an error line while the other exports are served (with none left, the server
    /// fails). A guest of an image probed as raw cannot give it another format: a write that
    /// would make its first 512 bytes probe as one, by qemu's rules (vmdk text descriptors
    /// included), fails with EPERM, as with qemu-nbd. `-f raw` serves any file's bytes as
    /// they are, without that check.
    #[arg(short, long, value_name = "FORMAT", value_enum)]
    pub format: Option<FormatArg>,
    /// A directory where the files a qcow2 image names (its backing files, its external data
    /// file) may lie besides the image's own directory; repeat for several. Those names come
    /// with the image, so they are not trusted: a named file is opened only where it really
    /// lies (symlinks followed) beneath the served image's directory or such a directory, and
    /// only if it is a regular file outside /proc and /sys (never a device, FIFO, socket or
    /// magic link, whatever is allowed); otherwise the export is left out with a line naming
    /// the image, the file and the rule. qemu-nbd opens whatever an image names. Per export
    /// in the config file: allow_backing_dir = ["DIR", ...].
    #[arg(long, value_name = "DIR")]
    pub allow_backing_dir: Vec<PathBuf>,
    /// Export every image read-only.
    #[arg(short, long)]
    pub read_only: bool,
    /// Snapshot mode, as qemu-nbd's -s: every image is opened read-only (shared locks) and
    /// the exports' writes, zeroings and trims go to a temporary overlay in $TMPDIR (an
    /// unnamed file, sparse, gone when the server exits, even on kill -9), so the image never
    /// changes. With --read-only: the image served read-only. Per export in the config file:
    /// snapshot = true.
    #[arg(short = 's', long)]
    pub snapshot: bool,
    /// Offer the qemu:allocation-depth metadata context on every export, as qemu-nbd's
    /// -A/--allocation-depth: block status saying which image of a qcow2 backing chain holds
    /// each extent (0 absent: in none, reads as zeroes; 1 local: the image itself; N: its
    /// (N-1)th backing file; a raw image is local throughout). Per export in the config file:
    /// allocation_depth = true.
    #[arg(short = 'A', long)]
    pub allocation_depth: bool,
    /// Offer the qcow2 image's persistent dirty bitmap NAME as the metadata context
    /// qemu:dirty-bitmap:NAME, as qemu-nbd's -B/--bitmap (flag 1: dirty, at the bitmap's
    /// granularity); repeat for several. It is looked for in the image, then down its
    /// backing chain. A bitmap that is missing, or inconsistent (in use when the image was
    /// last closed: a crash), is refused at start, as qemu-nbd refuses it; a disabled one is
    /// served as it is. Writes through a writable export set the bits of every enabled
    /// bitmap of the image, kept in memory with the bitmaps marked in use, and stored at a
    /// clean shutdown (as qemu stores them; after kill -9 they are inconsistent). Raw images
    /// have no bitmaps. Per export in the config file: bitmap = ["NAME", ...].
    #[arg(short = 'B', long, value_name = "NAME")]
    pub bitmap: Vec<String>,
    /// Take no image locks (qemu's -U): serve an image that qemu or another server has open.
    /// Without it, a writable export is refused while anyone else uses the image, and a
    /// read-only one while anyone writes it, as qemu-nbd does.
    #[arg(short = 'U', long)]
    pub force_share: bool,
    /// The Ceph configuration for rbd: exports (default: librados' search: $CEPH_CONF,
    /// /etc/ceph/ceph.conf, ~/.ceph/config, ./ceph.conf), as qemu's conf=.
    #[arg(long, value_name = "FILE")]
    pub ceph_conf: Option<PathBuf>,
    /// The Ceph client id for rbd: exports, without "client." (default admin), as qemu's id=.
    #[arg(long, value_name = "ID")]
    pub ceph_id: Option<String>,
    /// The keyring holding the client's key (default: the one the configuration names), as
    /// qemu's keyring=.
    #[arg(long, value_name = "FILE")]
    pub ceph_keyring: Option<PathBuf>,
    /// Seconds that connecting to the Ceph cluster, and then each RBD request, may take
    /// before it fails (the client then gets EIO; other exports keep serving). Requests to an
    /// OSD that restarts within it wait and complete.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub ceph_timeout: u64,
    /// Serve an internal snapshot of each qcow2 image (made by `qemu-img snapshot -c`)
    /// instead of its active disk, read-only, as qemu-nbd's --load-snapshot: its ID or name,
    /// or snapshot.id=ID,snapshot.name=NAME. qemu-nbd's short -l is --listen here. Per
    /// export in the config file: load_snapshot = "NAME".
    #[arg(long, value_name = "SNAPSHOT")]
    pub load_snapshot: Option<String>,
    /// Seconds an image file (with its backing chain) may take to open at start: one on a
    /// file system that hangs (NFS, FUSE) is then left out with an error line, and the
    /// other exports are served. 0: no deadline.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub open_timeout: u64,
    /// rbd: exports (writable ones), as rbd-nbd's --exclusive: take each image's exclusive
    /// lock at start and keep it until exit, so that no other client writes the image
    /// meanwhile; the server refuses to start, naming the holder, when another client holds
    /// it so. Without it, librbd's lock passes between writers as each one writes (its
    /// default, as with qemu and rbd-nbd): two servers on one image both write. The image
    /// needs the exclusive-lock feature (on by default).
    #[arg(long)]
    pub exclusive: bool,
    /// An rbd: export whose image `rbd encryption format` encrypted, served decrypted through
    /// librbd (rbd-nbd's option): NAME=FORMAT for export NAME, or FORMAT alone for every
    /// rbd: export; FORMAT is luks1 or luks2. Goes with --encryption-passphrase-file; a
    /// wrong passphrase stops the server with one line.
    #[arg(long, value_name = "[NAME=]FORMAT")]
    pub encryption_format: Vec<String>,
    /// The passphrase of an encrypted image: a qcow2 image encrypted with LUKS (`qemu-img
    /// create -o encrypt.format=luks`; the image says its format), or an --encryption-format
    /// rbd: export. NAME=FILE for export NAME, or FILE alone for every export (image files
    /// that are not encrypted ignore it; an rbd: export needs --encryption-format with it). The file's bytes are the passphrase, as `rbd encryption
    /// format` and qemu's `--object secret,file=FILE` read it (a trailing newline is part of
    /// it). A wrong passphrase stops the server with one line. Per export in the config file:
    /// encryption_passphrase_file = "FILE".
    #[arg(long, value_name = "[NAME=]FILE")]
    pub encryption_passphrase_file: Vec<String>,
    /// Create missing images, sparse, with this size (e.g. 1G, 512M).
    #[arg(long, value_name = "SIZE")]
    pub create: Option<String>,
    /// A description for an export, shown by `nbdinfo --list`: NAME=TEXT; repeat for
    /// several. A value without "=" is qemu-nbd's --description TEXT (see -D).
    #[arg(long, value_name = "NAME=TEXT")]
    pub description: Vec<String>,
    /// qemu-nbd's -D: the description of the positional FILE's export, or of the only
    /// export when there is no FILE (use --description NAME=TEXT with several).
    #[arg(short = 'D', value_name = "TEXT")]
    pub describe: Option<String>,
    /// Serve every image from byte OFFSET on (qemu-nbd's -o, --offset): an export is its
    /// image's disk from OFFSET to the end, which must lie beyond OFFSET (e.g. 1048576 or 1M).
    /// WRITE payloads then go through the server (the NIC does not place them in the file).
    /// qemu-nbd's -P/--partition is gone (qemu-nbd 10 refuses it): give the partition's start
    /// as OFFSET.
    #[arg(short = 'o', long, value_name = "OFFSET")]
    pub offset: Option<String>,
    /// TRIM, as qemu-nbd's --discard: unmap (or on; the default, unlike qemu-nbd's) punches
    /// holes, and WRITE_ZEROES may too; ignore (or off) accepts TRIM and does nothing, and
    /// WRITE_ZEROES writes zeroes without freeing space.
    #[arg(long, value_name = "DISCARD", value_enum)]
    pub discard: Option<DiscardArg>,
    /// As qemu-nbd's --detect-zeroes: on turns a WRITE whose data is all zeroes into a
    /// WRITE_ZEROES that keeps the space allocated; unmap into one that may free it (needs
    /// --discard unmap, the default); off (the default) writes the zeroes as data. Other than
    /// off, WRITE payloads go through the server to be inspected (the NIC does not place them
    /// in the file).
    #[arg(long, value_name = "MODE", value_enum)]
    pub detect_zeroes: Option<DetectZeroesArg>,
    /// When writes become durable, as qemu-nbd's --cache: writeback (the default) after a
    /// FLUSH or with FUA; writethrough every write, zeroing and trim before its reply (the
    /// NIC then does not place WRITE payloads); unsafe never (FLUSH and FUA do nothing: for
    /// scratch disks). none and directsync are writeback's and writethrough's durability:
    /// the host page cache is not bypassed here, since read replies are sent from the
    /// image's mapping.
    #[arg(long, value_name = "CACHE", value_enum)]
    pub cache: Option<CacheArg>,
    /// --cache none, as qemu-nbd's -n/--nocache.
    #[arg(short = 'n', long = "nocache", conflicts_with = "cache")]
    pub nocache: bool,
    /// qemu-nbd's --aio (threads, native, io_uring): accepted, and changes nothing: the NIC
    /// and the stores choose their own I/O (io_uring or epoll, splice, pread/pwrite).
    #[arg(long, value_name = "AIO", value_enum)]
    pub aio: Option<AioArg>,
    /// The export a client gets when it asks for the empty name.
    #[arg(long, value_name = "NAME")]
    pub default_export: Option<String>,
    /// Serve at most this many clients at once (default 64); only clients past the NBD
    /// handshake count, and one more is refused (its connection closed) with a log line.
    #[arg(long, value_name = "N")]
    pub max_connections: Option<usize>,
    /// --max-connections N, as qemu-nbd's --shared=N (0: no limit, as in qemu-nbd). Its -e
    /// is --export here.
    #[arg(long, value_name = "N", conflicts_with = "max_connections")]
    pub shared: Option<usize>,
    /// Connections still in their handshake at once (default 256); a new one beyond this
    /// drops the oldest, so idle or slow sockets cannot lock clients out. A handshake that
    /// takes longer than --handshake-limit is dropped in any case.
    #[arg(long, value_name = "N")]
    pub max_handshakes: Option<usize>,
    /// Seconds a client has to finish its handshake before it is dropped, as qemu-nbd's
    /// --handshake-limit (default 10; 0: no limit).
    #[arg(long, value_name = "N")]
    pub handshake_limit: Option<u64>,
    /// Close a client's connection after SECS without a request while nothing is in flight
    /// (default: never), or after SECS (at most 60) in which the client read none of the
    /// replies sent to it (without this option: 60 s). The client sees its server go away, as
    /// after a restart.
    #[arg(long, value_name = "SECS")]
    pub idle_timeout: Option<u64>,
    /// Memory for request and reply buffers shared by busy connections (default 256M). Each
    /// connection has 4 MiB of receive slots and 2 MiB of read buffers (replies of qcow2, RBD
    /// and tmpfs holes waiting to be read by the client) of its own; beyond that it takes from
    /// this pool, and once it is spent the connection stops reading requests: TCP flow control
    /// holds its client.
    #[arg(long, value_name = "SIZE")]
    pub buffer_memory: Option<String>,
    /// Do not answer NBD_OPT_LIST with the export names.
    #[arg(long)]
    pub no_list: bool,
    /// Run in the background once serving: the command returns (status 0) when the
    /// listeners are bound and the images open, or fails with the server's error. The
    /// server's stdout goes to /dev/null then, and so does its stderr (the log) if it is a
    /// pipe; redirect it to a file to keep the log: `--fork 2>>server.log`.
    #[arg(long)]
    pub fork: bool,
    /// Write the server's process id to FILE once it is serving (removed at a clean exit).
    #[arg(long, value_name = "FILE")]
    pub pid_file: Option<PathBuf>,
    /// Captive mode, as nbdkit's: once serving, run CMD with `sh -c`, where $uri (and $nbd)
    /// is the default export's nbd://HOST:PORT/EXPORT and $port the port (with only
    /// --socket: nbd+unix:///EXPORT?socket=PATH and $unixsocket); the server shuts
    /// down when CMD exits and exits with CMD's status. With --run and no address given, it
    /// listens on 127.0.0.1 at a free port.
    #[arg(long, value_name = "CMD")]
    pub run: Option<String>,
    /// TLS, as nbdkit's --tls: off; on (offered: a client may upgrade with STARTTLS or stay
    /// in plaintext); require (every option before STARTTLS is refused with
    /// NBD_REP_ERR_TLS_REQD). Default: require when --tls-certs or --tls-psk is given, else
    /// off. The soft NIC's engine does the TLS record layer; the LANai backend has no TLS.
    #[arg(long, value_enum, value_name = "MODE")]
    pub tls: Option<TlsArg>,
    /// X.509 credentials: a directory holding ca-cert.pem, server-cert.pem and
    /// server-key.pem (the layout of qemu's tls-creds-x509 and nbdkit's --tls-certificates).
    #[arg(long, value_name = "DIR")]
    pub tls_certs: Option<PathBuf>,
    /// With --tls-certs: accept only clients presenting a certificate signed by its
    /// ca-cert.pem.
    #[arg(long, requires = "tls_certs")]
    pub tls_verify_peer: bool,
    /// Pre-shared keys instead of certificates: a file in psktool's format (IDENTITY:HEXKEY
    /// per line); a client with any of them may connect.
    #[arg(long, value_name = "FILE", conflicts_with = "tls_certs")]
    pub tls_psk: Option<PathBuf>,
    /// Serve live statistics in Prometheus' text format (GET /metrics over HTTP) on ADDR:PORT
    /// (IPv6 in brackets, HOST:PORT; port 0 picks a free one, printed at start) or on a
    /// Unix-domain socket: unix:PATH, or a PATH with a "/" in it. Per export and per open
    /// connection (labelled by its id and peer address): requests by command, bytes read and
    /// written, errors by NBD error, latency histograms by command, requests in flight; open
    /// connections and handshakes. Off by default. A management port on the host's own
    /// network stack, not on the NIC: keep it on loopback or a management network (it has
    /// no authentication). Config file: metrics = "ADDR:PORT".
    #[arg(long, value_name = "ADDR:PORT|unix:PATH")]
    pub metrics: Option<String>,
    /// Shut down (as on SIGTERM) when the process that started the server exits.
    #[arg(long)]
    pub exit_with_parent: bool,
    // Logging: -v/-q from the default, info.
    #[command(flatten)]
    pub log: LogArgs,
    #[command(flatten)]
    pub nic: NicArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum DiscardArg {
    /// TRIM is accepted and does nothing.
    #[value(alias = "off")]
    Ignore,
    /// TRIM punches holes (the default).
    #[value(alias = "on")]
    Unmap,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum DetectZeroesArg {
    Off,
    On,
    Unmap,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum CacheArg {
    Writeback,
    Writethrough,
    Unsafe,
    None,
    Directsync,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum AioArg {
    Threads,
    Native,
    #[value(name = "io_uring")]
    IoUring,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum TlsArg {
    Off,
    On,
    Require,
}

/// An RBD image's encryption, as `--encryption-format` and the config file's
/// `encryption_format` spell it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EncryptionArg {
    Luks1,
    Luks2,
}

impl From<EncryptionArg> for EncryptionFormat {
    fn from(f: EncryptionArg) -> EncryptionFormat {
        match f {
            EncryptionArg::Luks1 => EncryptionFormat::Luks1,
            EncryptionArg::Luks2 => EncryptionFormat::Luks2,
        }
    }
}

/// An image's format, as `--format` and the config file's `format` spell it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FormatArg {
    /// The file's bytes are the disk.
    Raw,
    /// A qcow2 image (version 3 as `qemu-img create -f qcow2` makes it, or version 2, as
    /// `-o compat=0.10`): the disk is its virtual disk.
    Qcow2,
}

impl From<FormatArg> for Format {
    fn from(f: FormatArg) -> Format {
        match f {
            FormatArg::Raw => Format::Raw,
            FormatArg::Qcow2 => Format::Qcow2,
        }
    }
}

/// qemu-nbd's options that the server does not take, each refused by name with why and
/// what to use instead (README lists them under qemu-nbd's spellings).
pub(crate) const REFUSED: &[Refused] = &[
    Refused {
        names: &["-c", "--connect", "-d", "--disconnect"],
        tool: "qemu-nbd",
        why: "the kernel's NBD client (/dev/nbdN) is not used: mount the export with \
              qpip-nbd-mount and losetup its file",
    },
    Refused {
        names: &["-L", "--list"],
        tool: "qemu-nbd",
        why: "listing a server's exports is a client's job: qpip-nbd list URI (or qpip-nbd \
              info --list URI)",
    },
    Refused {
        names: &["--image-opts"],
        tool: "qemu-nbd",
        why: "not supported: give the image as FILE or --export NAME=PATH, with -f/--format, \
              -o/--offset and, for encrypt.key-secret, --encryption-passphrase-file FILE",
    },
    Refused {
        names: &["--object"],
        tool: "qemu-nbd",
        why: "QEMU objects are not supported: TLS credentials are --tls-certs DIR or --tls-psk \
              FILE, the LUKS passphrase of an encrypted qcow2 or RBD image \
              --encryption-passphrase-file FILE",
    },
    Refused {
        names: &["--tls-creds"],
        tool: "qemu-nbd",
        why: "TLS credentials are --tls-certs DIR (the layout of qemu's tls-creds-x509 \
              directory) or --tls-psk FILE",
    },
    Refused {
        names: &["--tls-authz"],
        tool: "qemu-nbd",
        why: "client certificates are checked with --tls-verify-peer, against --tls-certs' \
              CA",
    },
    Refused {
        names: &["--tls-hostname"],
        tool: "qemu-nbd",
        why: "a client's option (qemu-nbd -c or -L): a server checks no host name",
    },
    Refused {
        names: &["-T", "--trace"],
        tool: "qemu-nbd",
        why: "QEMU's trace events: the server logs with -v/--log (e.g. --log \
              nbd_server=debug)",
    },
];
