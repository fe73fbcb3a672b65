//! CPU-time accounting per thread and per process, from the kernel's CPU clocks.

use std::time::Duration;

fn clock(id: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer; an invalid clock id only yields an error.
    if unsafe { libc::clock_gettime(id, &mut ts) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// CPU time of the calling thread.
pub fn this_thread() -> Duration {
    clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// CPU time of thread `tid` of this process (Linux's per-thread CPU clock id encoding).
pub fn thread(tid: i32) -> Duration {
    let id = (!(tid as libc::clockid_t) << 3) | 6;
    clock(id)
}

/// Sum of the CPU time of several threads of this process.
pub fn threads(tids: &[i32]) -> Duration {
    tids.iter().map(|&t| thread(t)).sum()
}

/// The calling thread's kernel id.
#[cfg(test)]
pub fn tid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

/// Median of a non-empty list.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn other_thread_clock_matches_its_own_view() {
        let (tx, rx) = std::sync::mpsc::channel();
        let h = std::thread::spawn(move || {
            let t0 = std::time::Instant::now();
            while t0.elapsed() < Duration::from_millis(50) {}
            tx.send((tid(), this_thread())).unwrap();
            std::thread::sleep(Duration::from_millis(200));
        });
        let (t, own) = rx.recv().unwrap();
        let seen = thread(t);
        assert!(
            seen >= own && seen < own + Duration::from_millis(40),
            "{seen:?} vs {own:?}"
        );
        assert!(own >= Duration::from_millis(30));
        h.join().unwrap();
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
