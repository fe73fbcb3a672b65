//! One FUSE connection from INIT to the end: answers INIT (choosing the transport), then
//! serves requests on worker threads until the file system is unmounted.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

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

/// The state of the kernel's switch for FUSE over io_uring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UringSwitch {
    /// /sys/module/fuse/parameters/enable_uring does not exist: the kernel has no such
    /// transport.
    Missing,
    Off,
    On,
}

impl UringSwitch {
    pub const PATH: &str = "/sys/module/fuse/parameters/enable_uring";

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
    pub transport: Transport,
    /// Threads reading /dev/fuse (all requests on the dev transport; only FORGET and
    /// INTERRUPT once the ring is up).
    pub threads: usize,
    /// Ring entries (each with its thread) per queue.
    pub ring_depth: usize,
    pub writeback_cache: bool,
    pub read_only: bool,
}

/// What INIT settled.
#[derive(Debug)]
pub struct Started {
    pub uring: bool,
    pub agreed: Agreed,
    /// When io_uring was wanted (auto) but /dev/fuse is used: why.
    pub fallback: Option<String>,
}

/// A connection after INIT, with its workers to be started.
pub struct Session {
    fd: Arc<OwnedFd>,
    fs: Arc<NbdFs>,
    nic: Nic,
    entries: Vec<ring::Entry>,
    config: Config,
    /// The mount's device (major, minor), to abort the connection if the ring fails.
    device: Option<(u32, u32)>,
    pub started: Started,
}

fn init_error(what: String) -> io::Error {
    io::Error::other(what)
}

impl Session {
    /// Reads the kernel's INIT from `fd` and answers it.
    pub fn init(fd: OwnedFd, fs: Arc<NbdFs>, nic: Nic, config: Config) -> io::Result<Session> {
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
        // Rings are set up before INIT is answered: once the kernel is told io_uring, it
        // holds every request until all queues have entries.
        let mut entries = Vec::new();
        let mut ring_ok = Ok(());
        if config.transport != Transport::Dev && kernel_offers {
            let payload = MAX_IO as usize + 4096;
            'setup: for qid in 0..ring::queue_count() {
                for _ in 0..config.ring_depth.max(1) {
                    match ring::Entry::new(&nic, qid as u16, payload) {
                        Ok(e) => entries.push(e),
                        Err(e) => {
                            ring_ok = Err(e.to_string());
                            entries.clear();
                            break 'setup;
                        }
                    }
                }
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
                return Err(init_error(format!("--fuse-transport uring: {why}")));
            }
        };
        let want = Wants {
            max_write: MAX_IO,
            max_readahead: MAX_IO,
            max_background: 64,
            congestion_threshold: 48,
            writeback_cache: config.writeback_cache && !config.read_only,
            io_uring: uring,
        };
        let agreed = match proto::negotiate(&init, &want) {
            Ok(a) => a,
            Err(e) => {
                dev::reply(fd.as_raw_fd(), h.unique, Err(libc::EPROTO));
                return Err(init_error(e.to_string()));
            }
        };
        buf.write_at(dev::IN_CAP, bytes_of(&agreed.out));
        dev::reply(
            fd.as_raw_fd(),
            h.unique,
            Ok((&buf, dev::IN_CAP, size_of::<abi::fuse_init_out>())),
        );
        if !uring {
            entries.clear();
        }
        Ok(Session {
            fd: Arc::new(fd),
            fs,
            nic,
            entries,
            config,
            device: None,
            started: Started {
                uring,
                agreed,
                fallback,
            },
        })
    }

    /// The mount's device number: a ring failure then aborts the connection instead of
    /// leaving the kernel waiting for the ring forever.
    pub fn set_device(&mut self, dev: (u32, u32)) {
        self.device = Some(dev);
    }

    /// Serves until the file system is unmounted.
    pub fn run(self) -> io::Result<()> {
        let mut handles = Vec::new();
        let device = self.device;
        for (i, e) in self.entries.into_iter().enumerate() {
            let fd = self.fd.clone();
            let fs = self.fs.clone();
            handles.push(
                std::thread::Builder::new()
                    .name(format!("fuse-ring-{i}"))
                    .spawn(move || {
                        let r = e.serve(fd.as_raw_fd(), &fs);
                        if let Err(err) = &r {
                            tracing::error!("FUSE io_uring: {err}; aborting the connection");
                            match device {
                                Some(d) => {
                                    if let Err(e) = crate::mount::abort_connection(d) {
                                        tracing::error!("aborting the FUSE connection: {e}");
                                    }
                                }
                                None => tracing::error!("no device number to abort"),
                            }
                        }
                        r
                    })?,
            );
        }
        // On the ring only FORGET and INTERRUPT use /dev/fuse, and its readers see the end.
        let readers = if self.started.uring {
            1
        } else {
            self.config.threads.max(1)
        };
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
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
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
