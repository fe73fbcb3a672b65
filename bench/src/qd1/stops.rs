//! Whether a stack's processes were stopped (state T: SIGSTOP, or a job-control stop, from
//! outside the benchmark) while fio ran. On a shared machine another user's tool may pause
//! processes; a request then waits for as long as they stay stopped, which shows in the IOPS
//! and the maximum latency but is no property of the stack.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const TICK: Duration = Duration::from_millis(50);

/// The state letter of process `pid` (field 3 of /proc/PID/stat), if it can be read.
fn state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat[stat.rfind(')')? + 1..].trim_start().chars().next()
}

/// A 50 ms sleep that took this much longer means we were stopped ourselves (a tool that
/// pauses the benchmark pauses it whole, this watcher included).
const OVERRUN: Duration = Duration::from_millis(500);

/// Runs `run`, meanwhile sampling `pids` every 50 ms; returns its result and about how long
/// any of them, or this process, was stopped.
pub(super) fn watching<R>(pids: &[u32], run: impl FnOnce() -> R) -> (R, Duration) {
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            let mut stopped = Duration::ZERO;
            while !done.load(Ordering::Relaxed) {
                if pids.iter().any(|&p| matches!(state(p), Some('T' | 't'))) {
                    stopped += TICK;
                }
                let t = std::time::Instant::now();
                std::thread::sleep(TICK);
                if t.elapsed() > TICK + OVERRUN {
                    stopped += t.elapsed();
                }
            }
            stopped
        });
        let r = run();
        done.store(true, Ordering::Relaxed);
        (r, watcher.join().unwrap_or_default())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn sees_a_stopped_child_and_not_a_running_one() {
        let mut child = Command::new("sleep").arg("5").spawn().unwrap();
        let pid = child.id();
        let (_, running) = watching(&[pid], || std::thread::sleep(Duration::from_millis(300)));
        assert_eq!(running, Duration::ZERO);
        // SAFETY: kill with the pid of our unreaped child.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) };
        let (_, stopped) = watching(&[pid], || std::thread::sleep(Duration::from_millis(300)));
        let _ = child.kill();
        let _ = child.wait();
        assert!(stopped >= Duration::from_millis(150), "{stopped:?}");
        assert_eq!(state(u32::MAX), None);
    }
}
