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
pub(crate) fn this_thread() -> Duration {
    clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// CPU time of thread `tid` of this process (Linux's per-thread CPU clock id encoding).
pub(crate) fn thread(tid: i32) -> Duration {
    let id = (!(tid as libc::clockid_t) << 3) | 6;
    clock(id)
}

/// Sum of the CPU time of several threads of this process.
pub(crate) fn threads(tids: &[i32]) -> Duration {
    tids.iter().map(|&t| thread(t)).sum()
}

/// User and system CPU time of a whole process: all its threads, living and exited.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct ProcessCpu {
    pub user: Duration,
    pub system: Duration,
}

impl ProcessCpu {
    pub(crate) fn total(&self) -> Duration {
        self.user + self.system
    }
}

impl std::ops::Sub for ProcessCpu {
    type Output = ProcessCpu;
    fn sub(self, earlier: ProcessCpu) -> ProcessCpu {
        ProcessCpu {
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
        }
    }
}

/// CPU time of process `pid` from `/proc/PID/stat` (utime and stime, in clock ticks: 10 ms
/// resolution at the usual 100 Hz, fine for runs of seconds). Works for any process the caller
/// may see, e.g. a server it started.
pub(crate) fn process(pid: u32) -> std::io::Result<ProcessCpu> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path)?;
    parse_stat(&stat).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{path}: unexpected format"),
        )
    })
}

fn parse_stat(stat: &str) -> Option<ProcessCpu> {
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so fields are counted
    // from the last ')'. After it come fields 3 (state) onwards; utime is field 14, stime 15.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace().skip(14 - 3);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = if hz > 0 { hz as u64 } else { 100 };
    let ticks = |t: u64| Duration::from_nanos(t.saturating_mul(1_000_000_000) / hz);
    Some(ProcessCpu {
        user: ticks(utime),
        system: ticks(stime),
    })
}

/// CPU time of the threads of process `pid` whose name is `name` (e.g. the soft NIC's engine
/// thread, "qpip-soft-nic"): how much of a server's CPU went to its emulated NIC.
pub(crate) fn threads_named(pid: u32, name: &str) -> std::io::Result<ProcessCpu> {
    let mut sum = ProcessCpu {
        user: Duration::ZERO,
        system: Duration::ZERO,
    };
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let dir = entry?.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        if comm.trim_end() != name {
            continue;
        }
        // A thread may end between the listing and the read: it then counts as nothing.
        if let Some(t) = std::fs::read_to_string(dir.join("stat"))
            .ok()
            .as_deref()
            .and_then(parse_stat)
        {
            sum.user += t.user;
            sum.system += t.system;
        }
    }
    Ok(sum)
}

fn clock_ticks_per_s() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { hz as f64 } else { 100.0 }
}

/// Busy CPU time of the whole machine so far, from the first line of `/proc/stat`: user +
/// nice + system + irq + softirq, all CPUs (idle, iowait and steal excluded; guest time is
/// already inside user).
pub(crate) fn machine_busy() -> std::io::Result<Duration> {
    let stat = std::fs::read_to_string("/proc/stat")?;
    parse_machine(&stat).ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidData, "/proc/stat: no cpu line")
    })
}

fn parse_machine(stat: &str) -> Option<Duration> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let f: Vec<u64> = line
        .split_ascii_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal ...
    let busy = f.first()? + f.get(1)? + f.get(2)? + f.get(5)? + f.get(6)?;
    Some(Duration::from_secs_f64(busy as f64 / clock_ticks_per_s()))
}

/// One process as seen in `/proc/PID/stat`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ProcEntry {
    pub ppid: u32,
    pub cpu: Duration,
    /// A kernel thread (PF_KTHREAD): loop workers, kworkers doing writeback, ...
    pub kthread: bool,
}

/// Every process of the machine: CPU time (user+system, all threads), parent, kind.
pub(crate) fn all_processes() -> std::collections::HashMap<u32, ProcEntry> {
    let mut out = std::collections::HashMap::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(cpu) = parse_stat(&stat) else {
            continue;
        };
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        // After ')': state(3) ppid(4) pgrp session tty tpgid flags(9).
        let f: Vec<&str> = stat[close + 1..].split_ascii_whitespace().collect();
        let ppid = f.get(1).and_then(|x| x.parse().ok()).unwrap_or(0);
        let flags: u64 = f.get(6).and_then(|x| x.parse().ok()).unwrap_or(0);
        out.insert(
            pid,
            ProcEntry {
                ppid,
                cpu: cpu.total(),
                kthread: flags & 0x0020_0000 != 0 || pid == 2 || ppid == 2,
            },
        );
    }
    out
}

/// `pid` and all its descendants in a snapshot of [`all_processes`].
pub(crate) fn tree(
    procs: &std::collections::HashMap<u32, ProcEntry>,
    pid: u32,
) -> std::collections::HashSet<u32> {
    let mut set = std::collections::HashSet::from([pid]);
    loop {
        let before = set.len();
        for (&p, e) in procs {
            if set.contains(&e.ppid) {
                set.insert(p);
            }
        }
        if set.len() == before {
            return set;
        }
    }
}

/// The calling thread's kernel id.
#[cfg(test)]
pub(crate) fn tid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

/// Restricts thread `tid` (0: the calling thread) to one CPU. The micro benchmarks give each
/// simulated host one core, as two machines would have, so that neither stack gains or loses
/// by where the scheduler happens to put its threads.
pub(crate) fn pin(tid: i32, cpu: usize) -> std::io::Result<()> {
    // SAFETY: cpu_set_t is plain data; CPU_SET writes inside it; sched_setaffinity reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Lets thread `tid` (0: the calling thread) run on every CPU again.
pub(crate) fn unpin(tid: i32) -> std::io::Result<()> {
    // SAFETY: as in `pin`.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for cpu in 0..online_cpus() {
            libc::CPU_SET(cpu, &mut set);
        }
        if libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

pub(crate) fn online_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }).max(1) as usize
}

/// Median of a non-empty list.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
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
            // Busy until the thread itself has used 50 ms of CPU: wall time would give less
            // CPU on a loaded machine.
            while this_thread() < Duration::from_millis(50) {}
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
    fn process_stat_agrees_with_the_process_cpu_clock() {
        // No busy loop here: it would steal the CPU the thread-clock test above measures.
        let before = clock(libc::CLOCK_PROCESS_CPUTIME_ID);
        let stat = process(std::process::id()).unwrap().total();
        let after = clock(libc::CLOCK_PROCESS_CPUTIME_ID);
        // /proc/PID/stat counts whole clock ticks (10 ms at 100 Hz).
        let slack = Duration::from_millis(30);
        assert!(
            stat + slack >= before && stat <= after + slack,
            "{before:?} <= {stat:?} <= {after:?}"
        );
    }

    #[test]
    fn stat_parsing_survives_odd_command_names() {
        let line = "42 (a) b (c) R 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0 1";
        let c = parse_stat(line).unwrap();
        // SAFETY: sysconf takes no pointers and only reads a system constant.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
        assert_eq!(c.user, Duration::from_nanos(250 * 1_000_000_000 / hz));
        assert_eq!(c.system, Duration::from_nanos(50 * 1_000_000_000 / hz));
    }

    #[test]
    fn machine_line_sums_busy_fields() {
        let s = "cpu  100 5 50 1000 70 3 2 9 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n";
        let hz = clock_ticks_per_s();
        let d = parse_machine(s).unwrap().as_secs_f64();
        assert!((d - 160.0 / hz).abs() < 1e-9, "{d}");
        assert!(machine_busy().unwrap() > Duration::ZERO);
    }

    #[test]
    fn process_snapshot_sees_us_and_our_tree() {
        let procs = all_processes();
        let me = std::process::id();
        assert!(procs.contains_key(&me));
        assert!(!procs[&me].kthread);
        assert!(tree(&procs, me).contains(&me));
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
