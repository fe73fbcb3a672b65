//! Choosing and opening a store: the one place that knows every kind of store.
//!
//! An export's location is parsed here ([`Location`]: `rbd:POOL/IMAGE[@SNAP]`, else a file
//! path); a file's format is chosen or probed from its first bytes, as qemu-nbd does (qcow2
//! by its magic, raw otherwise; a format we do not serve is refused); `--create` makes a
//! missing raw image; qemu's image locks are taken; and the files a qcow2 image names are
//! opened only where the user allowed ([`named`]), a backing chain that loops refused.
//! Adding a store is one arm in [`Opener::open`] and the file that implements it.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
#[cfg(feature = "rbd")]
use std::sync::Arc;

use super::file::FileStore;
use super::lock::{self, LockError};
use super::named::{self, Allowed, Dir, Identity};
use super::probe::{self, Probed, QCOW2_MAGIC};
use super::qcow2::Qcow2;
use super::{CephOptions, Encryption, Store};

/// An image file's format, as `--format` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Format {
    /// The file's bytes are the disk.
    Raw,
    /// A qcow2 image (versions 3 and 2, with compressed clusters, a backing chain, an
    /// external data file or internal snapshots): the disk is its virtual disk.
    Qcow2,
}

impl Format {
    /// The format's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Format::Raw => "raw",
            Format::Qcow2 => "qcow2",
        }
    }
}

/// How one export's store is opened.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    /// Open the store read-only.
    pub read_only: bool,
    /// The file's format; None: probed from its first bytes.
    pub format: Option<Format>,
    /// Create a missing image file, sparse, with this many bytes; an existing one must have
    /// them.
    pub create: Option<u64>,
    /// Take qemu's image locks (false: `--force-share`).
    pub lock: bool,
    /// A writable RBD image: take its exclusive lock and keep it, refusing to open it when
    /// another client holds it (`--exclusive`, rbd-nbd's spelling).
    pub exclusive: bool,
    /// An encrypted RBD image: the format and passphrase to load (`--encryption-format`).
    pub encryption: Option<Encryption>,
    /// The file holding the passphrase of a qcow2 image encrypted with LUKS (its bytes as
    /// they are; `--encryption-passphrase-file`): the image says its own format. Images that
    /// are not encrypted ignore it.
    pub passphrase_file: Option<PathBuf>,
    /// Directories beside the image's own where the files a qcow2 image names (backing
    /// files, the external data file) may lie (`--allow-backing-dir`; see [`named`]).
    pub backing_dirs: Vec<PathBuf>,
    /// Serve this internal snapshot of a qcow2 image instead of its active disk, read-only
    /// (qemu-nbd's `--load-snapshot`: an ID or name, or `snapshot.id=ID,snapshot.name=NAME`).
    pub snapshot: Option<String>,
    /// How long an image file (with its backing chain) may take to open: one on a file
    /// system that hangs is then left out instead of stopping every other export
    /// (`--open-timeout`). None: no deadline.
    pub deadline: Option<std::time::Duration>,
}

/// Why a store could not be opened. Shown after the export's name.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// `--create` on an `rbd:` export.
    #[error("--create makes image files; make an RBD image with rbd create")]
    CreateRbd,
    /// `-f` other than raw for an `rbd:` export.
    #[error("an RBD image is served as raw (its bytes are the disk)")]
    RbdFormat,
    /// `--encryption-format` on an image file.
    #[error(
        "--encryption-format is for rbd: images (LUKS made by rbd encryption format); an encrypted qcow2 image says its own format (give it --encryption-passphrase-file only), and a raw LUKS image file is not served"
    )]
    EncryptionFile,
    /// The cluster or the image could not be reached.
    #[error("{0}")]
    Rbd(String),
    /// An `rbd:` export on a server built without the `rbd` feature.
    #[error(
        "rbd:{0}: this qpip-nbd-server was built without RBD support (build it with --features nbd-server/rbd, which needs librbd-dev)"
    )]
    NoRbd(String),
    /// `--create` for a qcow2 image that does not exist.
    #[error(
        "{} does not exist, and --create makes raw images only (make a qcow2 one with qemu-img create -f qcow2)",
        .0.display()
    )]
    CreateQcow2(PathBuf),
    /// `--create 0`.
    #[error("--create 0: an export needs at least one byte")]
    CreateEmpty,
    /// Creating the image file failed.
    #[error("creating {} ({size} bytes)", path.display())]
    Create {
        /// The file.
        path: PathBuf,
        /// The size asked for.
        size: u64,
        /// Why it failed.
        source: io::Error,
    },
    /// The file did not open within [`OpenOptions::deadline`].
    #[error(
        "opening {}: not done after {} s (a file system that hangs?); the export is left out (--open-timeout)",
        path.display(),
        deadline.as_secs_f64()
    )]
    TimedOut {
        /// The file.
        path: PathBuf,
        /// The deadline it missed.
        deadline: std::time::Duration,
    },
    /// The file could not be opened, or is in a format (or has qcow2 features) not served.
    #[error("opening {}{hint}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// How to serve it anyway, where there is a way.
        hint: &'static str,
        /// Why it failed.
        source: io::Error,
    },
    /// Another program holds the image, or locking failed.
    #[error("{}", path.display())]
    Lock {
        /// The image.
        path: PathBuf,
        /// What the lock says.
        source: LockError,
    },
    /// `--create SIZE` for an existing file of another size.
    #[error(
        "{} has {size} bytes, not the {asked} that --create asks for (drop --create to serve it as it is)",
        path.display()
    )]
    CreateSize {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The size `--create` asks for.
        asked: u64,
    },
}

impl OpenError {
    /// A file in a format the server does not serve (probed, or qcow2 features): it takes
    /// down its own export only, so that a guest cannot stop the server.
    pub fn unserved(&self) -> bool {
        match self {
            OpenError::Open { source, .. } => source.kind() == io::ErrorKind::Unsupported,
            OpenError::TimedOut { .. } => true,
            _ => false,
        }
    }
}

/// Where a store is, as an export names it.
#[derive(Clone, Copy, Debug)]
pub enum Location<'a> {
    /// `rbd:POOL/IMAGE[@SNAP]`: what follows `rbd:`.
    Rbd(&'a str),
    /// An image file or block device.
    File(&'a Path),
}

impl<'a> Location<'a> {
    /// Where `path` points: an `rbd:` image, or a file.
    pub fn parse(path: &'a Path) -> Location<'a> {
        match path.to_str().and_then(|p| p.strip_prefix("rbd:")) {
            Some(spec) => Location::Rbd(spec),
            None => Location::File(path),
        }
    }
}

/// Opens stores; holds what stores of one kind share (the Ceph cluster connection, made by
/// the first `rbd:` store).
#[derive(Default)]
pub struct Opener {
    ceph: CephOptions,
    #[cfg(feature = "rbd")]
    cluster: Option<Arc<super::rbd::Cluster>>,
}

impl Opener {
    /// An opener whose `rbd:` images reach their cluster as `ceph` says.
    pub fn new(ceph: CephOptions) -> Opener {
        Opener {
            ceph,
            #[cfg(feature = "rbd")]
            cluster: None,
        }
    }

    /// Opens the store at `path` (see [`Location`]).
    pub fn open(&mut self, path: &Path, opts: &OpenOptions) -> Result<Box<dyn Store>, OpenError> {
        match Location::parse(path) {
            Location::Rbd(spec) => self.open_rbd(spec, opts),
            Location::File(_) if opts.encryption.is_some() => Err(OpenError::EncryptionFile),
            Location::File(path) => match opts.deadline {
                None => open_file(path, opts),
                Some(deadline) => open_file_within(path, opts, deadline),
            },
        }
    }

    fn open_rbd(&mut self, spec: &str, opts: &OpenOptions) -> Result<Box<dyn Store>, OpenError> {
        if opts.create.is_some() {
            return Err(OpenError::CreateRbd);
        }
        if opts.format == Some(Format::Qcow2) {
            return Err(OpenError::RbdFormat);
        }
        self.connect_rbd(spec, opts)
    }

    #[cfg(feature = "rbd")]
    fn connect_rbd(&mut self, spec: &str, opts: &OpenOptions) -> Result<Box<dyn Store>, OpenError> {
        use super::rbd::{Cluster, RbdImage, RbdSpec};
        let spec = RbdSpec::parse(spec).map_err(OpenError::Rbd)?;
        let cluster = match &self.cluster {
            Some(c) => c.clone(),
            None => {
                let c = Cluster::connect(&self.ceph).map_err(OpenError::Rbd)?;
                self.cluster = Some(c.clone());
                c
            }
        };
        let image = RbdImage::open(
            cluster,
            &spec,
            opts.read_only,
            opts.exclusive,
            opts.encryption.as_ref(),
        )
        .map_err(OpenError::Rbd)?;
        Ok(Box::new(image))
    }

    #[cfg(not(feature = "rbd"))]
    fn connect_rbd(
        &mut self,
        spec: &str,
        _opts: &OpenOptions,
    ) -> Result<Box<dyn Store>, OpenError> {
        let _ = &self.ceph;
        Err(OpenError::NoRbd(spec.to_owned()))
    }
}

/// A sparse raw disk of `size` bytes in anonymous memory (a memfd), gone when the server
/// exits: no path anyone else can reach or plant a symlink at. `name` shows in
/// /proc/PID/fd and is the store's location in logs.
pub fn anonymous(name: &str, size: u64) -> io::Result<Box<dyn Store>> {
    Ok(Box::new(FileStore::anonymous(name, size)?))
}

/// [`open_file`] on a thread of its own, waited for until `deadline`: an open, or a read of
/// a header, on a file system that hangs (NFS, FUSE) blocks in the kernel, where nothing can
/// interrupt it; the thread is then left behind and the export left out.
fn open_file_within(
    path: &Path,
    opts: &OpenOptions,
    deadline: std::time::Duration,
) -> Result<Box<dyn Store>, OpenError> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (p, o) = (path.to_owned(), opts.clone());
    std::thread::Builder::new()
        .name("qpip-open".into())
        .spawn(move || {
            let _ = tx.send(open_file(&p, &o));
        })
        .map_err(|source| OpenError::Open {
            path: path.to_owned(),
            hint: "",
            source,
        })?;
    rx.recv_timeout(deadline).unwrap_or_else(|_| {
        Err(OpenError::TimedOut {
            path: path.to_owned(),
            deadline,
        })
    })
}

/// An image file: created if asked and missing, its format chosen or probed, locked.
fn open_file(path: &Path, opts: &OpenOptions) -> Result<Box<dyn Store>, OpenError> {
    // A FIFO (or socket, or character device) would block an open for read, or serve a
    // stream: only regular files and block devices are disks. stat does not block.
    if let Ok(m) = std::fs::metadata(path) {
        use std::os::unix::fs::MetadataExt;
        let kind = m.mode() & libc::S_IFMT;
        if kind != libc::S_IFREG && kind != libc::S_IFBLK {
            return Err(OpenError::Open {
                path: path.to_owned(),
                hint: "",
                source: io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!(
                        "is {}: only regular files and block devices are served",
                        named::kind_name(kind)
                    ),
                ),
            });
        }
    }
    let mut format = opts.format;
    if let Some(size) = opts.create
        && !path.exists()
    {
        if format == Some(Format::Qcow2) {
            return Err(OpenError::CreateQcow2(path.to_owned()));
        }
        if size == 0 {
            return Err(OpenError::CreateEmpty);
        }
        FileStore::create(path, size).map_err(|source| OpenError::Create {
            path: path.to_owned(),
            size,
            source,
        })?;
        format = Some(Format::Raw); // ours: not probed
    }
    // An internal snapshot is served read-only, as qemu-nbd serves it.
    let read_only_snapshot;
    let opts = if opts.snapshot.is_some() && !opts.read_only {
        read_only_snapshot = OpenOptions {
            read_only: true,
            ..opts.clone()
        };
        &read_only_snapshot
    } else {
        opts
    };
    let mut chain = Chain {
        top: path,
        dirs: &opts.backing_dirs,
        allowed: None,
        seen: Vec::new(),
        tables_left: MAX_CHAIN_TABLE_BYTES,
        snapshot: opts.snapshot.as_deref(),
        passphrase: opts.passphrase_file.as_deref(),
    };
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .write(!opts.read_only)
        .open(path)
        .and_then(|file| {
            chain.seen.push(named::identity(&file)?);
            open_image(
                path,
                file,
                None,
                opts.read_only,
                format,
                opts.lock,
                &mut chain,
                0,
            )
        });
    let (store, file) = opened.map_err(|source| {
        // A read-only file or file system: say how to serve it anyway.
        let hint = match source.raw_os_error() {
            Some(libc::EROFS | libc::EACCES | libc::EPERM) if !opts.read_only => {
                " (to export it read-only, add --read-only)"
            }
            _ => "",
        };
        OpenError::Open {
            path: path.to_owned(),
            hint,
            source,
        }
    })?;
    if opts.lock {
        lock::lock(&file, opts.read_only).map_err(|source| OpenError::Lock {
            path: path.to_owned(),
            source,
        })?;
    }
    if let Some(asked) = opts.create
        && store.size() != asked
    {
        return Err(OpenError::CreateSize {
            path: path.to_owned(),
            size: store.size(),
            asked,
        });
    }
    Ok(store)
}

/// How many images a backing chain may have below the one served: a longer chain is
/// refused. qemu sets no such bound; 32 is far past the chains that image tools and clouds
/// make. (A chain that loops is refused at the first image met twice.)
pub const MAX_BACKING_DEPTH: usize = 32;

pub use super::qcow2::MAX_CHAIN_TABLE_BYTES;

/// What opening one export's images keeps, from the served image down its backing chain.
struct Chain<'a> {
    /// The served image, as the user named it.
    top: &'a Path,
    /// The user's `--allow-backing-dir`s.
    dirs: &'a [PathBuf],
    /// Where the files the images name may lie: found when the first name is opened.
    allowed: Option<Allowed>,
    /// The images and data files opened so far: a file met again is refused (a loop).
    seen: Vec<Identity>,
    /// What the tables of the images still to be opened may take.
    tables_left: u64,
    /// The internal snapshot to serve of the top image (taken when it is opened).
    snapshot: Option<&'a str>,
    /// The passphrase file of the top image, if it is encrypted (taken when it is opened).
    passphrase: Option<&'a Path>,
}

impl Chain<'_> {
    fn allowed(&mut self) -> io::Result<&Allowed> {
        let allowed = match self.allowed.take() {
            Some(a) => a,
            None => Allowed::new(self.top, self.dirs)?,
        };
        Ok(self.allowed.insert(allowed))
    }

    /// Opens `name`, which an image in `dir` names, as `chain.allowed()` allows; refuses a
    /// file already in the chain (`why` says what that means).
    fn open_named(
        &mut self,
        dir: &Dir,
        name: &str,
        shown: &Path,
        write: bool,
        why: impl FnOnce() -> String,
    ) -> io::Result<File> {
        let (file, id) = self.allowed()?.open(dir, name, shown, write)?;
        if self.seen.contains(&id) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("refused: {}", why()),
            ));
        }
        self.seen.push(id);
        Ok(file)
    }
}

/// Opens the image at `path`, open in `file`, in `format`, or probes its format from its
/// first bytes (`None`). A format we do not serve (vmdk, vdi, qcow version 1, luks, ...) is
/// refused unless `format` forces raw. Also returns a descriptor of the same open file
/// description, to lock (the locks then last as long as the store's descriptor). A qcow2
/// image's data file and backing file are opened here too, as `named` allows (`dir`: where
/// the image's names are resolved; None: beside `path`): the data file as writable as the
/// image, the backing file read-only; each locked as qemu locks it when `lock`. `depth` is
/// the image's own depth in the chain.
#[allow(clippy::too_many_arguments)]
fn open_image(
    path: &Path,
    file: File,
    dir: Option<Dir>,
    read_only: bool,
    format: Option<Format>,
    lock: bool,
    chain: &mut Chain,
    depth: usize,
) -> io::Result<(Box<dyn Store>, File)> {
    let head = probe::read_head(&file)?;
    let probed = format.is_none();
    let format = match format {
        Some(f) => f,
        None => match probe::probe(&head, Some(path)) {
            Probed::Raw => Format::Raw,
            Probed::Qcow2 => Format::Qcow2,
            Probed::Other(name) => {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!(
                        "is a {name} image, which is not served (only raw and qcow2): convert it with qemu-img convert -O qcow2, or add --format raw to serve its bytes as they are"
                    ),
                ));
            }
        },
    };
    let for_lock = file.try_clone()?;
    let store: Box<dyn Store> = match format {
        Format::Raw if chain.snapshot.is_some() => {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "is a raw image: it has no internal snapshots to load (--load-snapshot is for qcow2)",
            ));
        }
        Format::Raw => Box::new(FileStore::open(path, file, read_only, probed)?),
        Format::Qcow2 => {
            if !head.starts_with(QCOW2_MAGIC) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "is not a qcow2 image (no qcow2 magic in its first bytes); drop --format qcow2 to serve it as raw",
                ));
            }
            // crypt_method: qemu opens an encrypted backing file with a secret of its own,
            // which this server has no way to be given.
            if depth > 0 && head.get(32..36).is_some_and(|m| m != [0; 4]) {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    "is encrypted: an encrypted backing file is not served",
                ));
            }
            let snapshot = chain.snapshot.take();
            let passphrase = chain.passphrase.take();
            let mut q = Qcow2::open(
                path,
                file,
                read_only,
                &mut chain.tables_left,
                snapshot,
                passphrase,
            )?;
            let data_file = q.data_file_name().map(str::to_owned);
            let backing = q
                .backing_name()?
                .map(|(name, format)| (name.to_owned(), format.map(str::to_owned)));
            if data_file.is_some() || backing.is_some() {
                let dir = match dir {
                    Some(dir) => dir,
                    None => Dir::of(path)?,
                };
                if let Some(name) = data_file {
                    let shown = q.beside(&name);
                    q.set_data_file(open_data_file(&dir, &name, &shown, read_only, lock, chain)?);
                }
                if let Some((name, format)) = backing {
                    let shown = q.beside(&name);
                    let backing = open_backing(
                        path,
                        (&dir, &name, &shown),
                        format.as_deref(),
                        lock,
                        chain,
                        depth + 1,
                    )?;
                    q.set_backing(backing);
                }
            }
            Box::new(q)
        }
    };
    Ok((store, for_lock))
}

/// Opens a qcow2 image's external data file `name` (in `dir`, shown as `shown`), as writable
/// as the image, and locks it as the image is locked (qemu locks both). Errors name it,
/// after the image's own name.
fn open_data_file(
    dir: &Dir,
    name: &str,
    shown: &Path,
    read_only: bool,
    lock: bool,
    chain: &mut Chain,
) -> io::Result<File> {
    let named =
        |e: io::Error| io::Error::new(e.kind(), format!("its data file {}: {e}", shown.display()));
    let file = chain
        .open_named(dir, name, shown, !read_only, || {
            "it is already in the chain, as an image or a data file".into()
        })
        .map_err(named)?;
    if lock {
        lock::lock(&file, read_only).map_err(|e| named(io::Error::other(e.to_string())))?;
    }
    Ok(file)
}

/// Opens backing file `name` (in `dir`, shown as `shown`) of `image` read-only (a qcow2 or
/// raw image: the format the overlay's header names, or probed) and locks it shared. Errors
/// name it, after the overlay's own name.
fn open_backing(
    image: &Path,
    (dir, name, shown): (&Dir, &str, &Path),
    format: Option<&str>,
    lock: bool,
    chain: &mut Chain,
    depth: usize,
) -> io::Result<Box<dyn Store>> {
    let named = |e: io::Error| {
        io::Error::new(
            e.kind(),
            format!("its backing file {}: {e}", shown.display()),
        )
    };
    if depth > MAX_BACKING_DEPTH {
        return Err(named(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("the backing chain is deeper than {MAX_BACKING_DEPTH} images"),
        )));
    }
    let format = match format {
        None => None,
        Some("qcow2") => Some(Format::Qcow2),
        Some("raw") => Some(Format::Raw),
        Some(other) => {
            return Err(named(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("is a {other} image: not supported as a backing file (only raw and qcow2)"),
            )));
        }
    };
    let file = chain
        .open_named(dir, name, shown, false, || {
            format!(
                "the backing chain loops: {} names {}, which is already in the chain",
                image.display(),
                shown.display()
            )
        })
        .map_err(named)?;
    let names_in = dir.of_named(name).map_err(named)?;
    let (store, file) = open_image(
        shown,
        file,
        Some(names_in),
        true,
        format,
        lock,
        chain,
        depth,
    )
    .map_err(named)?;
    if lock {
        lock::lock(&file, true).map_err(|e| named(io::Error::other(e.to_string())))?;
    }
    Ok(store)
}
