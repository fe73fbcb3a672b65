//! One FUSE connection from INIT to the end: answers INIT (choosing the transport), then
//! serves requests on worker threads until the file system is unmounted.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, mpsc};

use qpip_core::Nic;

use crate::abi::{self, bytes_of};
use crate::dev;
use crate::fs::{MAX_IO, NbdFs};
use crate::proto::{self, Agreed, Op, Wants};
use crate::ring;

/// How the kernel's requests reach the mount.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Transport {
    /// io_uring when the kernel offers it, /dev/fuse otherwise (saying why).
    Auto,
    /// FUSE over io_uring, or fail.
    Uring,
    /// read and write on /dev/fuse.
    Dev,
}

/// What the kernel caches of the export's file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Cache {
    /// The page cache holds reads and writes; dirty pages go to the server in the
    /// background (FUSE_WRITEBACK_CACHE) and fsync waits for them.
    Writeback,
    /// The page cache holds reads; every write(2) waits for the server.
    Writethrough,
    /// No page cache (FOPEN_DIRECT_IO): every read and write goes to the server, as with
    /// qemu-storage-daemon's FUSE export: large sequential copies cost half the CPU. (A file
    /// system on a loop device is served as well by `losetup --direct-io=on` in any mode.)
    None,
}

/// The state of the kernel's switch for FUSE over io_uring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UringSwitch {
    /// /sys/module/fuse/parameters/enable_uring does not exist: the kernel has no such
    /// transport.
    Missing,
    /// The switch is off.
    Off,
    /// The switch is on.
    On,
}

impl UringSwitch {
    /// The switch's file.
    pub const PATH: &str = "/sys/module/fuse/parameters/enable_uring";

    /// Reads the switch.
    pub fn read() -> UringSwitch {
        match std::fs::read_to_string(Self::PATH) {
            Ok(s) if s.trim() == "Y" || s.trim() == "1" => UringSwitch::On,
            Ok(_) => UringSwitch::Off,
            Err(_) => UringSwitch::Missing,
        }
    }
}

/// The transport to use: Ok((use io_uring, why not when it was wanted but is not used)),
/// Err when `--fuse-transport uring` cannot be had. `ring`: whether io_uring rings could be
/// set up in this process (containers and seccomp filters forbid them).
pub fn decide(
    requested: Transport,
    kernel_offers: bool,
    switch: UringSwitch,
    ring: &Result<(), String>,
) -> Result<(bool, Option<String>), String> {
    if requested == Transport::Dev {
        return Ok((false, None));
    }
    let why_not = if !kernel_offers {
        Some(match switch {
            UringSwitch::Missing => "this kernel has no FUSE io_uring transport (it needs Linux \
                 6.14+ built with CONFIG_FUSE_IO_URING)"
                .to_string(),
            UringSwitch::Off => format!(
                "FUSE over io_uring is switched off ({} is N; scripts/setup turns it on)",
                UringSwitch::PATH
            ),
            UringSwitch::On => "the kernel did not offer FUSE_OVER_IO_URING at INIT".to_string(),
        })
    } else {
        ring.as_ref()
            .err()
            .map(|e| format!("io_uring is not available to this process: {e}"))
    };
    match (requested, why_not) {
        (_, None) => Ok((true, None)),
        (Transport::Uring, Some(why)) => Err(why),
        (_, Some(why)) => Ok((false, Some(why))),
    }
}

/// Settings of the connection.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// How requests come from the kernel.
    pub transport: Transport,
    /// Threads reading /dev/fuse (all requests on the dev transport; only FORGET and
    /// INTERRUPT once the ring is up).
    pub threads: usize,
    /// Ring entries (each with its thread) per queue.
    pub ring_depth: usize,
    /// How the kernel caches the file.
    pub cache: Cache,
    /// Mount read-only.
    pub read_only: bool,
}

/// What INIT settled.
#[derive(Debug)]
pub struct Started {
    /// The io_uring transport is in use.
    pub uring: bool,
    /// What INIT agreed.
    pub agreed: Agreed,
    /// When io_uring was wanted (auto) but /dev/fuse is used: why.
    pub fallback: Option<String>,
}

/// A connection after INIT, with its workers to be started.
pub struct Session {
    fd: Arc<OwnedFd>,
    fs: Arc<NbdFs>,
    nic: Nic,
    /// The ring entries' threads, waiting to register until [`Session::run`] (the kernel
    /// holds requests until then).
    rings: Option<RingThreads>,
    config: Config,
    /// What INIT settled.
    pub started: Started,
}

/// The threads of the ring entries, each with its entry set up and checked, waiting for the
/// word to register (true) or to end (false).
struct RingThreads {
    handles: Vec<std::thread::JoinHandle<io::Result<()>>>,
    go: Vec<mpsc::Sender<bool>>,
}

impl RingThreads {
    /// Starts `per_queue` entries on every queue. Err: some entry could not be set up (the
    /// others are stopped).
    fn start(
        fd: &Arc<OwnedFd>,
        fs: &Arc<NbdFs>,
        nic: &Nic,
        per_queue: usize,
    ) -> Result<RingThreads, String> {
        let payload = MAX_IO as usize + 4096;
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        let mut t = RingThreads {
            handles: Vec::new(),
            go: Vec::new(),
        };
        for qid in 0..ring::queue_count() {
            for k in 0..per_queue.max(1) {
                let (go_tx, go_rx) = mpsc::channel::<bool>();
                let (fd, fs, nic, ready) = (fd.clone(), fs.clone(), nic.clone(), ready_tx.clone());
                let spawned = std::thread::Builder::new()
                    .name(format!("fuse-ring-{qid}.{k}"))
                    .spawn(move || {
                        let entry = match ring::Entry::new(&nic, qid as u16, payload) {
                            Ok(e) => {
                                let _ = ready.send(Ok(()));
                                e
                            }
                            Err(e) => {
                                let _ = ready.send(Err(e.to_string()));
                                return Ok(());
                            }
                        };
                        drop(ready);
                        if go_rx.recv() != Ok(true) {
                            return Ok(());
                        }
                        // A failed REGISTER sends the kernel back to /dev/fuse, whose
                        // readers carry on; either way the mount keeps being served.
                        if let Err(e) = entry.serve(fd.as_raw_fd(), &fs) {
                            tracing::warn!("FUSE io_uring entry {qid}.{k} stopped: {e}");
                        }
                        Ok(())
                    });
                match spawned {
                    Ok(h) => {
                        t.handles.push(h);
                        t.go.push(go_tx);
                    }
                    Err(e) => {
                        t.stop();
                        return Err(format!("starting a ring thread: {e}"));
                    }
                }
            }
        }
        drop(ready_tx);
        let mut result = Ok(());
        for r in ready_rx.iter().take(t.handles.len()) {
            if let Err(e) = r {
                result = Err(e);
            }
        }
        match result {
            Ok(()) => Ok(t),
            Err(e) => {
                t.stop();
                Err(e)
            }
        }
    }

    fn stop(self) {
        for g in &self.go {
            let _ = g.send(false);
        }
        for h in self.handles {
            let _ = h.join();
        }
    }

    fn go(self) -> Vec<std::thread::JoinHandle<io::Result<()>>> {
        for g in &self.go {
            let _ = g.send(true);
        }
        self.handles
    }
}

fn init_error(what: String) -> io::Error {
    io::Error::other(what)
}

impl Session {
    /// Reads the kernel's INIT from `fd` and answers it.
    pub fn init(fd: OwnedFd, fs: Arc<NbdFs>, nic: Nic, config: Config) -> io::Result<Session> {
        let fd = Arc::new(fd);
        let buf = dev::buffer(&nic);
        let (h, init) = loop {
            let Some(n) = dev::read_message(fd.as_raw_fd(), &buf)? else {
                return Err(init_error("the connection ended before INIT".into()));
            };
            // SAFETY: the first n bytes were just written by read(2).
            let msg = unsafe { std::slice::from_raw_parts(buf.as_ptr(), n) };
            let (h, args) =
                proto::split_message(msg).map_err(|e| init_error(format!("INIT: {e}")))?;
            let parsed = proto::split_args(h.opcode, args)
                .and_then(|(op_in, rest)| proto::parse(h.opcode, op_in, rest));
            match parsed {
                Ok(Op::Init(init)) => break (h, init),
                _ => {
                    tracing::warn!(opcode = h.opcode, "request before INIT");
                    dev::reply(fd.as_raw_fd(), h.unique, Err(libc::EIO));
                }
            }
        };
        let kernel_offers = proto::offers_io_uring(&init);
        // Rings are set up (each by the thread that will serve it) before INIT is answered:
        // once the kernel is told io_uring, it holds every request until all queues have
        // entries.
        let mut rings = None;
        let mut ring_ok = Ok(());
        if config.transport != Transport::Dev && kernel_offers {
            match RingThreads::start(&fd, &fs, &nic, config.ring_depth) {
                Ok(t) => rings = Some(t),
                Err(e) => ring_ok = Err(e),
            }
        }
        let (uring, fallback) = match decide(
            config.transport,
            kernel_offers,
            UringSwitch::read(),
            &ring_ok,
        ) {
            Ok(x) => x,
            Err(why) => {
                dev::reply(fd.as_raw_fd(), h.unique, Err(libc::EPROTO));
                if let Some(t) = rings {
                    t.stop();
                }
                return Err(init_error(format!("--fuse-transport uring: {why}")));
            }
        };
        let want = Wants {
            max_write: MAX_IO,
            max_readahead: MAX_IO,
            max_background: 64,
            congestion_threshold: 48,
            writeback_cache: config.cache == Cache::Writeback && !config.read_only,
            direct_io: config.cache == Cache::None,
            io_uring: uring,
        };
        let agreed = match proto::negotiate(&init, &want) {
            Ok(a) => a,
            Err(e) => {
                dev::reply(fd.as_raw_fd(), h.unique, Err(libc::EPROTO));
                if let Some(t) = rings {
                    t.stop();
                }
                return Err(init_error(e.to_string()));
            }
        };
        buf.write_at(dev::IN_CAP, bytes_of(&agreed.out));
        dev::reply(
            fd.as_raw_fd(),
            h.unique,
            Ok((&buf, dev::IN_CAP, size_of::<abi::fuse_init_out>())),
        );
        let rings = match rings {
            Some(t) if uring => Some(t),
            Some(t) => {
                t.stop();
                None
            }
            None => None,
        };
        Ok(Session {
            fd,
            fs,
            nic,
            rings,
            config,
            started: Started {
                uring,
                agreed,
                fallback,
            },
        })
    }

    /// Serves until the file system is unmounted.
    pub fn run(self) -> io::Result<()> {
        // REGISTER needs the connection initialised, which the INIT answer did.
        let mut handles = self.rings.map(RingThreads::go).unwrap_or_default();
        // On the ring only FORGET and INTERRUPT use /dev/fuse, and its readers see the end;
        // but if an entry fails to register, the kernel takes every request back to
        // /dev/fuse, so the readers are as many as on that transport (idle otherwise).
        let readers = self.config.threads.max(1);
        for i in 0..readers {
            let fd = self.fd.clone();
            let fs = self.fs.clone();
            let mr = dev::buffer(&self.nic);
            handles.push(
                std::thread::Builder::new()
                    .name(format!("fuse-dev-{i}"))
                    .spawn(move || dev::worker(fd.as_raw_fd(), &fs, mr))?,
            );
        }
        let writeback = self.started.agreed.writeback_cache();
        let size_watch = watch_size(self.fd.clone(), self.fs.clone(), writeback);
        let mut first_err = None;
        for h in handles {
            match h.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::error!("FUSE worker: {e}");
                    first_err.get_or_insert(e);
                }
                Err(_) => {
                    first_err.get_or_insert(io::Error::other("a FUSE worker panicked"));
                }
            }
        }
        // The watch holds the export: it ends (and lets it go) before we return.
        if let Some((stop, h)) = size_watch {
            drop(stop);
            let _ = h.join();
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// How often the size watch looks at the export's size.
const SIZE_WATCH: std::time::Duration = std::time::Duration::from_millis(200);
/// How often it asks the server, where the export offers RESIZE (its size may change).
const SIZE_PROBE: std::time::Duration = std::time::Duration::from_secs(2);

/// Follows the export's size: when a reconnect finds it resized (a server restarted on a
/// grown or shrunk image), or, for an export that offers RESIZE (`rbd:` exports), the size
/// the server gives a probe every [`SIZE_PROBE`] differs (`rbd resize` under a running
/// server), the kernel is told to drop the file's attributes and its page cache
/// (FUSE_NOTIFY_INVAL_INODE), so that `stat` shows the new size and no cached byte past a
/// shrunk end is read again. Under a writeback cache, where the kernel keeps an inode's
/// size itself, the file also gets a new node id and its name's entry is dropped
/// (FUSE_NOTIFY_INVAL_ENTRY): opening it again gives the new size. From its own thread: the kernel may wait in
/// the notification for pages that a request being served holds. Ends when the returned
/// sender is dropped.
fn watch_size(
    fd: Arc<OwnedFd>,
    fs: Arc<NbdFs>,
    writeback: bool,
) -> Option<(mpsc::Sender<()>, std::thread::JoinHandle<()>)> {
    let (stop, stopped) = mpsc::channel::<()>();
    let spawned = std::thread::Builder::new()
        .name("fuse-size".into())
        .spawn(move || {
            let mut known = fs.export().size();
            let mut probed = std::time::Instant::now();
            while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(SIZE_WATCH) {
                if fs.export().resizable() && probed.elapsed() >= SIZE_PROBE {
                    fs.export().probe_size();
                    probed = std::time::Instant::now();
                }
                let Some(now) = fs.size_changed(known) else {
                    continue;
                };
                let old_node = fs.file_node();
                let mut told = dev::notify_inval_inode(fd.as_raw_fd(), old_node, 0, 0);
                if writeback && told.is_ok() {
                    fs.renew_file_node();
                    told = dev::notify_inval_entry(fd.as_raw_fd(), crate::fs::DIR, fs.name());
                }
                match told {
                    Ok(()) => {
                        tracing::info!(
                            "the export is now {now} bytes (was {known}): the file follows"
                        );
                    }
                    // Unmounted.
                    Err(e) if e.raw_os_error() == Some(libc::ENODEV) => return,
                    // ENOENT: the kernel holds no inode for the file; it asks afresh.
                    Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                    Err(e) => {
                        tracing::warn!("telling the kernel the file is now {now} bytes: {e}")
                    }
                }
                known = now;
            }
        });
    match spawned {
        Ok(h) => Some((stop, h)),
        Err(e) => {
            tracing::warn!("the file will not follow the export's size: starting its thread: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_uses_the_ring_when_offered_and_says_why_not() {
        let ok = Ok(());
        assert_eq!(
            decide(Transport::Auto, true, UringSwitch::On, &ok),
            Ok((true, None))
        );
        let (uring, why) = decide(Transport::Auto, false, UringSwitch::Off, &ok).unwrap();
        assert!(!uring);
        assert!(why.unwrap().contains("enable_uring is N"));
        let (_, why) = decide(Transport::Auto, false, UringSwitch::Missing, &ok).unwrap();
        assert!(why.unwrap().contains("CONFIG_FUSE_IO_URING"));
        let denied = Err("Operation not permitted".to_string());
        let (uring, why) = decide(Transport::Auto, true, UringSwitch::On, &denied).unwrap();
        assert!(!uring && why.unwrap().contains("not permitted"));
        // dev: never the ring, nothing to explain.
        assert_eq!(
            decide(Transport::Dev, true, UringSwitch::On, &ok),
            Ok((false, None))
        );
        // uring: an error instead of a fallback.
        assert!(decide(Transport::Uring, false, UringSwitch::Off, &ok).is_err());
        assert!(decide(Transport::Uring, true, UringSwitch::On, &denied).is_err());
        assert_eq!(
            decide(Transport::Uring, true, UringSwitch::On, &ok),
            Ok((true, None))
        );
    }
}
