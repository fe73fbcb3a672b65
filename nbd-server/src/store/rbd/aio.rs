//! librbd's asynchronous completions and image-update callbacks, as the safe types the
//! image uses: a completion that owns an `rbd_completion_t` and wakes its connection, a
//! request in flight, the watch that follows the image's size.

use super::*;

/// What a completion's callback reaches: marked done, then the connection woken.
pub(super) struct Notify {
    pub(super) done: AtomicBool,
    pub(super) waker: Waker,
}

/// librbd's completion callback, on one of its threads: the operation's result is set.
/// librbd's own "complete" state comes only after the callback returns, so the waiter looks
/// at `done`, not at rbd_aio_is_complete.
pub(super) unsafe extern "C" fn on_complete(_c: ffi::rbd_completion_t, arg: *mut c_void) {
    // SAFETY: arg is the Notify boxed in the Completion, which is released (and the box
    // dropped) only after rbd_aio_wait_for_complete, i.e. after this callback has returned.
    let n = unsafe { &*(arg as *const Notify) };
    n.done.store(true, Ordering::Release);
    n.waker.wake_by_ref();
}

/// One librbd completion, released when dropped; one that was submitted and not waited
/// for is waited for first, so that librbd is done with the operation's buffer.
pub(super) struct Completion {
    pub(super) c: ffi::rbd_completion_t,
    /// Submitted (an aio call took it) and not yet waited for.
    pub(super) armed: bool,
    /// With a callback: what it marks and wakes (dropped after the completion is released).
    pub(super) notify: Option<Box<Notify>>,
}

// SAFETY: a completion may be waited for and released from any thread.
unsafe impl Send for Completion {}

impl Completion {
    pub(super) fn new() -> io::Result<Completion> {
        let mut c: ffi::rbd_completion_t = std::ptr::null_mut();
        // SAFETY: c is a valid out-pointer; no callback (we wait for it instead).
        check(unsafe { ffi::rbd_aio_create_completion(std::ptr::null_mut(), None, &mut c) })?;
        Ok(Completion {
            c,
            armed: false,
            notify: None,
        })
    }

    /// A completion whose callback wakes `waker` once the operation is done.
    pub(super) fn waking(waker: &Waker) -> io::Result<Completion> {
        let notify = Box::new(Notify {
            done: AtomicBool::new(false),
            waker: waker.clone(),
        });
        let arg = &*notify as *const Notify as *mut c_void;
        let mut c: ffi::rbd_completion_t = std::ptr::null_mut();
        // SAFETY: c is a valid out-pointer; arg points at the boxed Notify, which lives (at
        // the same address) until after the completion is released (see Drop).
        check(unsafe { ffi::rbd_aio_create_completion(arg, Some(on_complete), &mut c) })?;
        Ok(Completion {
            c,
            armed: false,
            notify: Some(notify),
        })
    }

    /// The callback has run: the result is there, and waiting does not block (for long).
    pub(super) fn is_done(&self) -> bool {
        self.notify
            .as_ref()
            .is_some_and(|n| n.done.load(Ordering::Acquire))
    }

    /// Submits an operation with this completion.
    pub(super) fn submit(
        &mut self,
        submit: impl FnOnce(ffi::rbd_completion_t) -> c_int,
    ) -> io::Result<()> {
        check(submit(self.c))?;
        self.armed = true;
        Ok(())
    }

    /// Waits for the operation submitted with this completion; its return value.
    pub(super) fn wait(mut self) -> io::Result<isize> {
        // SAFETY: the completion was passed to an aio call that returned 0, so librbd will
        // complete it; after the wait it touches neither it nor the call's buffer.
        let r = unsafe {
            ffi::rbd_aio_wait_for_complete(self.c);
            ffi::rbd_aio_get_return_value(self.c)
        };
        self.armed = false;
        if r < 0 { Err(errno(r as i64)) } else { Ok(r) }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        // SAFETY: created by rbd_aio_create_completion; an armed one is waited for, so that
        // librbd no longer uses it (nor its operation's buffer) when it is released.
        unsafe {
            if self.armed {
                ffi::rbd_aio_wait_for_complete(self.c);
            }
            ffi::rbd_aio_release(self.c)
        }
    }
}

/// A read or write under way (see [`Store::start_read`], [`Store::start_write`]).
pub(super) struct InFlight {
    pub(super) completion: Completion,
    pub(super) what: &'static str,
    /// For a read: the bytes it must deliver (librbd returns fewer only past the end of the
    /// image, which requests never reach).
    pub(super) len: Option<usize>,
    pub(super) spec: String,
}

impl Pending for InFlight {
    fn is_done(&self) -> bool {
        self.completion.is_done()
    }

    fn wait(self: Box<Self>) -> io::Result<()> {
        let r = self.completion.wait().and_then(|n| match self.len {
            Some(len) if n as usize != len => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("librbd read {n} of {len} bytes"),
            )),
            _ => Ok(()),
        });
        if let Err(e) = &r {
            tracing::warn!("{} on {}: {e}", self.what, self.spec);
        }
        r
    }
}

/// The image's size as librbd last said, kept up to date by its update watch: what
/// [`on_update`] sees, boxed so that its address stays put while librbd holds it.
pub(super) struct SizeWatch {
    pub(super) image: ffi::rbd_image_t,
    pub(super) size: AtomicU64,
    pub(super) spec: String,
}

/// rbd_update_watch's callback, on a librbd thread after the image's header changed
/// (`rbd resize`, a snapshot, a feature, ...): reads the size again.
pub(super) unsafe extern "C" fn on_update(arg: *mut c_void) {
    // SAFETY: arg is the boxed SizeWatch registered with rbd_update_watch, which outlives
    // the watch (Drop unwatches, which waits for a callback under way, before it goes).
    let w = unsafe { &*(arg as *const SizeWatch) };
    let mut size = 0u64;
    // SAFETY: the image is open for as long as the watch is registered.
    let r = unsafe { ffi::rbd_get_size(w.image, &mut size) };
    if r < 0 {
        tracing::warn!("{}: reading its size after an update: {}", w.spec, errno(r));
        return;
    }
    let old = w.size.swap(size, Ordering::SeqCst);
    if old != size {
        tracing::info!(
            "{}: resized from {old} to {size} bytes; new connections get the new size",
            w.spec
        );
    }
}
