//! fio as a client: its nbd engine (libnbd over a TCP socket) against a peer server, or its
//! psync engine on a file (a FUSE mount's); one job run and its JSON report read back.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use super::peers::{Running, die_with_parent};

/// One fio job against a server's URI: `jobs` connections (fio's --numjobs), each moving its
/// own slice of `size` bytes, reported together.
pub(crate) struct Job<'a> {
    /// fio's --name.
    pub name: &'a str,
    /// "write" or "read" (fio's --rw, and the key of its figures in the JSON).
    pub rw: &'static str,
    pub bs: u64,
    pub iodepth: u32,
    /// Connections, each with `iodepth` requests in flight.
    pub jobs: u32,
    /// Bytes moved in all (each job moves `size / jobs` from its own offset).
    pub size: u64,
    /// --runtime: stop after this long even if `size` is not done.
    pub runtime: Option<Duration>,
    /// In a process group of its own (a terminal's Ctrl-C reaches only qpip-bench).
    pub own_group: bool,
}

/// What fio reports of one job.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Report {
    pub io_bytes: f64,
    pub bw_bytes: f64,
    pub runtime_s: f64,
    /// fio's own CPU (usr + sys) over its runtime, in seconds.
    pub cpu_s: f64,
    /// The fio process's wall time, start to exit, in seconds.
    pub wall_s: f64,
}

/// `fio --version`, or "" if it does not run.
pub(crate) fn version() -> String {
    Command::new("fio")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// Runs `job` against `server`; `what` names it in errors.
pub(crate) fn run(job: &Job, server: &Running, what: &str) -> Result<Report> {
    let mut cmd = Command::new("fio");
    cmd.args([
        &format!("--name={}", job.name),
        "--ioengine=nbd",
        &format!("--uri={}", server.uri()),
        &format!("--rw={}", job.rw),
        &format!("--bs={}", job.bs),
        &format!("--iodepth={}", job.iodepth),
    ]);
    let jobs = job.jobs.max(1);
    let slice = job.size / u64::from(jobs);
    cmd.args([
        format!("--size={slice}"),
        format!("--offset_increment={slice}"),
        format!("--numjobs={jobs}"),
    ]);
    if let Some(t) = job.runtime {
        cmd.arg(format!("--runtime={}ms", t.as_millis().max(1)));
    }
    cmd.args(["--group_reporting", "--output-format=json"])
        .stdin(Stdio::null());
    if job.own_group {
        cmd.process_group(0);
    }
    die_with_parent(&mut cmd);
    let started = std::time::Instant::now();
    let out = cmd.output().context("running fio")?;
    let wall_s = started.elapsed().as_secs_f64();
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "fio {what} ({}) failed with {}:\n{}{}\nserver log:\n{}",
            server.uri(),
            out.status,
            String::from_utf8_lossy(&out.stderr),
            stdout,
            server.log_tail()
        );
    }
    let mut report = parse(&stdout, job.rw).with_context(|| format!("fio {what}"))?;
    report.wall_s = wall_s;
    Ok(report)
}

/// One time-based fio job on a file: `bs`-byte requests one at a time (the psync engine,
/// queue depth 1) with O_DIRECT, at offsets over the file's first `size` bytes.
pub(crate) struct FileJob<'a> {
    /// fio's --name.
    pub name: &'a str,
    pub file: &'a Path,
    pub dir: RandDir,
    pub bs: u64,
    pub size: u64,
    pub runtime: Duration,
    /// In a process group of its own (a terminal's Ctrl-C reaches only qpip-bench).
    pub own_group: bool,
}

/// The direction of a [`FileJob`]: random reads or random writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RandDir {
    Read,
    Write,
}

impl RandDir {
    pub(crate) const BOTH: [RandDir; 2] = [RandDir::Read, RandDir::Write];

    /// fio's --rw.
    pub(crate) fn rw(self) -> &'static str {
        match self {
            RandDir::Read => "randread",
            RandDir::Write => "randwrite",
        }
    }

    /// The key of its figures in fio's JSON.
    fn key(self) -> &'static str {
        match self {
            RandDir::Read => "read",
            RandDir::Write => "write",
        }
    }
}

/// What fio reports of a [`FileJob`]: operations, rate and completion latency.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LatencyReport {
    /// Requests completed.
    pub ios: f64,
    pub iops: f64,
    /// Completion latency percentiles, in microseconds.
    pub clat_p50_us: f64,
    pub clat_p99_us: f64,
    pub clat_p99_9_us: f64,
    /// The slowest request: stalls beyond the 99th percentile show here (and in the IOPS).
    pub clat_max_us: f64,
    pub runtime_s: f64,
    /// fio's own CPU (usr + sys) over its runtime, in seconds.
    pub cpu_s: f64,
}

/// Runs `job`; `what` names it in errors.
pub(crate) fn run_file(job: &FileJob, what: &str) -> Result<LatencyReport> {
    let file = job
        .file
        .to_str()
        .with_context(|| format!("{} is not UTF-8", job.file.display()))?;
    let mut cmd = Command::new("fio");
    cmd.args([
        format!("--name={}", job.name),
        // fio splits --filename at ':'.
        format!("--filename={}", file.replace(':', "\\:")),
        format!("--rw={}", job.dir.rw()),
        format!("--bs={}", job.bs),
        format!("--size={}", job.size),
        format!("--runtime={}ms", job.runtime.as_millis().max(1)),
    ]);
    cmd.args([
        "--ioengine=psync",
        "--iodepth=1",
        "--direct=1",
        "--time_based",
        "--output-format=json",
    ])
    .stdin(Stdio::null());
    if job.own_group {
        cmd.process_group(0);
    }
    die_with_parent(&mut cmd);
    let out = cmd.output().context("running fio")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "fio {what} on {file} failed with {}:\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            stdout.trim()
        );
    }
    parse_latency(&stdout, job.dir).with_context(|| format!("fio {what} on {file}"))
}

fn first_job(stdout: &str) -> Result<Value> {
    let json = &stdout[stdout.find('{').context("fio printed no JSON")?..];
    let mut v: Value = serde_json::from_str(json).context("parsing fio's JSON output")?;
    let job = v
        .get_mut("jobs")
        .and_then(|j| j.get_mut(0))
        .context("fio JSON has no jobs[0]")?
        .take();
    let err = num(&job, &["error"])?;
    if err != 0.0 {
        bail!("job error {err}");
    }
    Ok(job)
}

fn parse_latency(stdout: &str, dir: RandDir) -> Result<LatencyReport> {
    let job = first_job(stdout)?;
    let d = dir.key();
    let runtime_s = num(&job, &["job_runtime"])? / 1e3;
    let ios = num(&job, &[d, "total_ios"])?;
    if ios == 0.0 {
        bail!("no {} completed", dir.rw());
    }
    let pct = |p: &str| num(&job, &[d, "clat_ns", "percentile", p]).map(|ns| ns / 1e3);
    Ok(LatencyReport {
        ios,
        iops: num(&job, &[d, "iops"])?,
        clat_p50_us: pct("50.000000")?,
        clat_p99_us: pct("99.000000")?,
        clat_p99_9_us: pct("99.900000")?,
        clat_max_us: num(&job, &[d, "clat_ns", "max"])? / 1e3,
        runtime_s,
        cpu_s: (num(&job, &["usr_cpu"])? + num(&job, &["sys_cpu"])?) / 100.0 * runtime_s,
    })
}

/// Reads the first job of fio's JSON output (which may follow notices); fails on a job error.
fn parse(stdout: &str, rw: &str) -> Result<Report> {
    let job = first_job(stdout)?;
    let runtime_s = num(&job, &["job_runtime"])? / 1e3;
    Ok(Report {
        io_bytes: num(&job, &[rw, "io_bytes"])?,
        bw_bytes: num(&job, &[rw, "bw_bytes"])?,
        runtime_s,
        cpu_s: (num(&job, &["usr_cpu"])? + num(&job, &["sys_cpu"])?) / 100.0 * runtime_s,
        wall_s: 0.0,
    })
}

fn num(v: &Value, path: &[&str]) -> Result<f64> {
    let mut cur = v;
    for p in path {
        cur = cur
            .get(p)
            .with_context(|| format!("fio JSON has no {}", path.join(".")))?;
    }
    cur.as_f64()
        .with_context(|| format!("fio JSON {} is not a number", path.join(".")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_first_job_after_notices() {
        let out = r#"note: something
{"jobs":[{"error":0,"job_runtime":2000,"usr_cpu":10.0,"sys_cpu":15.0,
 "write":{"io_bytes":1000000,"bw_bytes":500000}}]}"#;
        let r = parse(out, "write").unwrap();
        assert_eq!(r.io_bytes, 1e6);
        assert_eq!(r.bw_bytes, 5e5);
        assert_eq!(r.runtime_s, 2.0);
        assert!((r.cpu_s - 0.5).abs() < 1e-9);
        let bad = r#"{"jobs":[{"error":5,"job_runtime":1}]}"#;
        assert!(
            parse(bad, "write")
                .unwrap_err()
                .to_string()
                .contains("job error 5")
        );
        assert!(parse("no json", "read").is_err());
    }

    #[test]
    fn reads_latency_percentiles_in_microseconds() {
        let out = r#"{"jobs":[{"error":0,"job_runtime":8000,"usr_cpu":5.0,"sys_cpu":20.0,
 "read":{"total_ios":0,"iops":0},
 "write":{"total_ios":80000,"iops":10000.5,
  "clat_ns":{"max":9000000,
   "percentile":{"50.000000":85000,"99.000000":250000,"99.900000":900000}}}}]}"#;
        let r = parse_latency(out, RandDir::Write).unwrap();
        assert_eq!(r.ios, 80000.0);
        assert_eq!(r.iops, 10000.5);
        assert_eq!(r.clat_p50_us, 85.0);
        assert_eq!(r.clat_p99_us, 250.0);
        assert_eq!(r.clat_p99_9_us, 900.0);
        assert_eq!(r.clat_max_us, 9000.0);
        assert!((r.cpu_s - 2.0).abs() < 1e-9);
        let e = parse_latency(out, RandDir::Read).unwrap_err();
        assert!(e.to_string().contains("no randread completed"), "{e}");
    }
}
