//! The one place a thread that runs or watches a queue sleeps ([`crate::drive`]'s wake
//! table): `ppoll(2)` on the processor's descriptor
//! ([`crate::machines::shell::Processor::watch_fd`], which its waker makes readable too)
//! and, for the NIC thread, its [`Kick`]. The processor itself never sleeps — it steps, and
//! says what to watch and when its timers are due — as smoltcp's interface never sleeps and
//! only its caller waits on the device.

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
}
