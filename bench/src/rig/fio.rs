//! fio's nbd engine (libnbd over a TCP socket) as the client of a peer server: one job run
//! and its JSON report read back.

use std::os::unix::process::CommandExt;
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

/// Reads the first job of fio's JSON output (which may follow notices); fails on a job error.
fn parse(stdout: &str, rw: &str) -> Result<Report> {
    let json = &stdout[stdout.find('{').context("fio printed no JSON")?..];
    let v: Value = serde_json::from_str(json).context("parsing fio's JSON output")?;
    let job = v
        .get("jobs")
        .and_then(|j| j.get(0))
        .context("fio JSON has no jobs[0]")?;
    let err = num(job, &["error"])?;
    if err != 0.0 {
        bail!("job error {err}");
    }
    let runtime_s = num(job, &["job_runtime"])? / 1e3;
    Ok(Report {
        io_bytes: num(job, &[rw, "io_bytes"])?,
        bw_bytes: num(job, &[rw, "bw_bytes"])?,
        runtime_s,
        cpu_s: (num(job, &["usr_cpu"])? + num(job, &["sys_cpu"])?) / 100.0 * runtime_s,
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
}
