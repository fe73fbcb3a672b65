//! The one place a thread that runs or watches a queue sleeps ([`crate::drive`]'s wake
//! table): `ppoll(2)` on the processor's descriptor
//! ([`crate::machines::shell::Processor::watch_fd`], which its waker makes readable too)
//! and, for the NIC thread, its [`Kick`]. The processor itself never sleeps — it steps, and
//! says what to watch and when its timers are due — as smoltcp's interface never sleeps and
//! only its caller waits on the device. A processor whose descriptor is an epoll instance
//! lends the sleep its event buffer ([`EpollEvents`]): the sleep is then `epoll_wait(2)` on
//! it and the step that follows takes the events it returned, so a sleep and that step cost
//! one system call, not a `ppoll` and then the step's own `epoll_wait`.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// The NIC thread's own wake-up, an eventfd in every sleep of that thread: a kick reaches it
/// parked, watching or in the doorbell wait, and one that comes before it sleeps ends its
/// next sleep at once (the count stays until a sleep that saw it takes it).
pub(crate) struct Kick(OwnedFd);

impl Kick {
    pub(crate) fn new() -> io::Result<Kick> {
        // SAFETY: eventfd has no memory preconditions; the descriptor is checked below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: eventfd returned a descriptor nothing else owns.
        Ok(Kick(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Wakes the NIC thread wherever it sleeps, or ends its next sleep at once.
    pub(crate) fn ring(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer. A full count (EAGAIN) is readable anyway.
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Takes the count, once a sleep has seen it (before the sleeper looks again).
    fn take(&self) {
        let mut count = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live buffer; nonblocking.
        unsafe { libc::read(self.0.as_raw_fd(), count.as_mut_ptr().cast(), count.len()) };
    }
}

/// Sleeps until `watch` is readable, `kick` is rung or `timeout` passes (None: no limit).
/// The sleeper has announced itself and looked for work after the fence of its pair; what
/// woke it is for its next look (and the next step) to find.
pub(crate) fn sleep(watch: Option<RawFd>, kick: Option<&Kick>, timeout: Option<Duration>) {
    let pollfd = |fd| libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let mut fds = [pollfd(-1), pollfd(-1)];
    let mut n = 0;
    if let Some(fd) = watch {
        fds[n] = pollfd(fd);
        n += 1;
    }
    let kick_at = kick.map(|k| {
        fds[n] = pollfd(k.0.as_raw_fd());
        n += 1;
        n - 1
    });
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `n` valid pollfds, a live timespec or null, no signal mask. EINTR or a failure
    // ends the sleep early: the sleeper looks again.
    let ready = unsafe {
        libc::ppoll(
            fds.as_mut_ptr(),
            n as libc::nfds_t,
            ts_ptr,
            std::ptr::null(),
        )
    };
    if ready > 0
        && let (Some(k), Some(i)) = (kick, kick_at)
        && fds[i].revents != 0
    {
        k.take();
    }
}

/// An epoll instance's ready events: filled by a sleep on it (`sleep_epoll`) or by the
/// processor's own look ([`EpollEvents::look`]), taken by the processor's next step.
pub struct EpollEvents {
    buf: Vec<libc::epoll_event>,
    len: usize,
}

impl EpollEvents {
    /// Room for `capacity` events per wait.
    pub fn with_capacity(capacity: usize) -> Self {
        EpollEvents {
            buf: vec![libc::epoll_event { events: 0, u64: 0 }; capacity.max(1)],
            len: 0,
        }
    }

    /// Whether a sleep left events that no step has taken.
    pub fn pending(&self) -> bool {
        self.len > 0
    }

    /// Takes what `epfd` has ready without blocking (or, `block`, waits for it: only the
    /// last reaping of a stopping NIC), unless a sleep already left events.
    pub fn look(&mut self, epfd: RawFd, block: bool) -> io::Result<()> {
        if self.len == 0 {
            self.wait(epfd, if block { -1 } else { 0 })?;
        }
        Ok(())
    }

    /// The events found, as (token, epoll event bits), each handed out once.
    pub fn drain(&mut self) -> impl Iterator<Item = (u64, u32)> + '_ {
        let len = std::mem::take(&mut self.len);
        self.buf[..len].iter().map(|e| {
            // Copies out of the (packed) kernel layout.
            let (token, bits) = (e.u64, e.events);
            (token, bits)
        })
    }

    fn wait(&mut self, epfd: RawFd, timeout_ms: libc::c_int) -> io::Result<()> {
        let cap = self.buf.len().min(libc::c_int::MAX as usize) as libc::c_int;
        // SAFETY: `cap` writable events in a live buffer.
        let n = unsafe { libc::epoll_wait(epfd, self.buf.as_mut_ptr(), cap, timeout_ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::Interrupted => Ok(()),
                _ => Err(e),
            };
        }
        self.len = n as usize;
        Ok(())
    }
}

/// [`sleep`] for a processor whose descriptor `epfd` is an epoll instance lending its event
/// buffer: `epoll_wait(2)` until an event (the waker's is in the same set), at most
/// `timeout`; what woke the sleeper stays in `events` for the next step.
pub(crate) fn sleep_epoll(epfd: RawFd, events: &mut EpollEvents, timeout: Option<Duration>) {
    let ms = timeout.map_or(-1, |t| {
        // Rounded up: a timer due in 0.3 ms must not turn the sleep into a spin.
        let ms = t.as_nanos().div_ceil(1_000_000);
        ms.min(libc::c_int::MAX as u128) as libc::c_int
    });
    if events.pending() {
        return;
    }
    // A failure ends the sleep early: the sleeper looks again (its step reports it).
    let _ = events.wait(epfd, ms);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_kick_rung_before_the_sleep_ends_it_at_once_and_is_taken() {
        let kick = Kick::new().unwrap();
        kick.ring();
        let t0 = Instant::now();
        sleep(None, Some(&kick), Some(Duration::from_secs(10)));
        assert!(t0.elapsed() < Duration::from_secs(5));
        // Taken: the next sleep lasts its timeout.
        let t0 = Instant::now();
        sleep(None, Some(&kick), Some(Duration::from_millis(20)));
        assert!(t0.elapsed() >= Duration::from_millis(20));
    }

    #[test]
    fn a_kick_from_another_thread_ends_an_untimed_sleep() {
        let kick = std::sync::Arc::new(Kick::new().unwrap());
        let ringer = {
            let kick = kick.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(10));
                kick.ring();
            })
        };
        sleep(None, Some(&kick), None);
        ringer.join().unwrap();
    }

    /// A sleep on an epoll instance leaves what woke it for the step, which takes it without
    /// a system call of its own.
    #[test]
    fn an_epoll_sleep_hands_its_events_to_the_look_after_it() {
        // SAFETY: plain descriptor creation; both checked and owned below.
        let (ep, ev) = unsafe {
            (
                libc::epoll_create1(libc::EPOLL_CLOEXEC),
                libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC),
            )
        };
        assert!(ep >= 0 && ev >= 0);
        // SAFETY: the descriptors were just created and nothing else owns them.
        let (ep, ev) = unsafe { (OwnedFd::from_raw_fd(ep), OwnedFd::from_raw_fd(ev)) };
        let mut reg = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLET) as u32,
            u64: 7,
        };
        // SAFETY: a live event for two live descriptors.
        let r = unsafe {
            libc::epoll_ctl(
                ep.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                ev.as_raw_fd(),
                &mut reg,
            )
        };
        assert_eq!(r, 0);
        let ring = Kick(ev);
        ring.ring();
        let mut events = EpollEvents::with_capacity(4);
        sleep_epoll(ep.as_raw_fd(), &mut events, Some(Duration::from_secs(10)));
        assert!(events.pending());
        // Edge-triggered and already taken by the sleep: a look of its own would find nothing.
        events.look(ep.as_raw_fd(), false).unwrap();
        let got: Vec<_> = events.drain().collect();
        assert_eq!(got, [(7, libc::EPOLLIN as u32)]);
        assert!(!events.pending());
        let t0 = Instant::now();
        sleep_epoll(ep.as_raw_fd(), &mut events, Some(Duration::from_millis(20)));
        assert!(t0.elapsed() >= Duration::from_millis(20));
        assert!(!events.pending());
    }
}
