//! `--metrics`: live statistics in Prometheus' text format, scraped over HTTP while real
//! clients (fio's nbd engine, qemu-io) use the server; the figures checked against fio's
//! own counts, the text against the exposition format, and the management port against
//! garbage and slow clients.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use nbd::client::{NbdClient, handshake};

const MIB: u64 = 1 << 20;

/// A server exporting `a` (64 MiB) with `--metrics 127.0.0.1:0`, and its metrics address.
fn server_with_metrics(dir: &Path, extra: &[&str]) -> (ServerProcess, String) {
    let img = image(dir, "a.img", 64 * MIB);
    let mut a = args(&["--export", &format!("a={}", img.display())]);
    a.extend(args(extra));
    let srv = start_server_v4(&a);
    let addr = metrics_line(&srv);
    (srv, addr)
}

/// What follows "metrics on " in the server's log: `http://ADDR/metrics` → `ADDR`, or
/// `unix:PATH (...)` → `unix:PATH`.
fn metrics_line(srv: &ServerProcess) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = srv.log();
        if let Some(rest) = log.lines().find_map(|l| l.split("metrics on ").nth(1)) {
            let rest = rest.split(' ').next().unwrap();
            return match rest.strip_prefix("http://") {
                Some(r) => r.trim_end_matches("/metrics").to_string(),
                None => rest.to_string(),
            };
        }
        assert!(Instant::now() < deadline, "no metrics line in:\n{log}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends `request` to the metrics listener at `addr` and reads the answer to its end.
fn exchange(addr: &str, request: &[u8]) -> String {
    fn go(mut s: impl Read + Write, request: &[u8]) -> String {
        s.write_all(request).unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        String::from_utf8(out).unwrap()
    }
    match addr.strip_prefix("unix:") {
        Some(path) => {
            let s = UnixStream::connect(path).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            go(s, request)
        }
        None => {
            let s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            go(s, request)
        }
    }
}

/// `GET /metrics`: the body of a 200 answer.
fn scrape(addr: &str) -> String {
    let answer = exchange(addr, b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n");
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    body.to_string()
}

/// One sample: its metric name and labels.
type Series = (String, BTreeMap<String, String>);

/// Parses the text exposition format (0.0.4) strictly: every line is a `# HELP`/`# TYPE`
/// comment or `name{label="value",...} value`; every sample belongs to a family that has
/// HELP and TYPE lines before it (a histogram's samples are its `_bucket`, `_sum` and
/// `_count`; a `_bucket` has `le`); no series twice; histogram buckets are cumulative and
/// end with `+Inf` equal to `_count`. Panics with the line at fault.
fn parse_exposition(text: &str) -> BTreeMap<Series, f64> {
    let mut help = BTreeSet::new();
    let mut types: BTreeMap<String, String> = BTreeMap::new();
    let mut samples = BTreeMap::new();
    let valid_name = |n: &str| {
        !n.is_empty()
            && !n.starts_with(|c: char| c.is_ascii_digit())
            && n.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
    };
    assert!(text.ends_with('\n'), "the text ends with a newline");
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# ") {
            let mut w = rest.splitn(3, ' ');
            let (kind, name) = (w.next().unwrap(), w.next().expect(line));
            assert!(valid_name(name), "bad name in {line:?}");
            match kind {
                "HELP" => assert!(help.insert(name.to_string()), "second HELP: {line:?}"),
                "TYPE" => {
                    let t = w.next().expect(line);
                    assert!(
                        ["counter", "gauge", "histogram", "summary", "untyped"].contains(&t),
                        "{line:?}"
                    );
                    assert!(types.insert(name.into(), t.into()).is_none(), "{line:?}");
                }
                _ => panic!("unknown comment {line:?}"),
            }
            continue;
        }
        assert!(!line.is_empty() && !line.starts_with('#'), "line {line:?}");
        let (series, value) = line.rsplit_once(' ').expect(line);
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("value in {line:?}")),
        };
        let (name, labels) = match series.split_once('{') {
            None => (series, BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').expect(line);
                (name, parse_labels(body, line))
            }
        };
        assert!(valid_name(name), "bad name in {line:?}");
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| {
                let base = name.strip_suffix(s)?;
                (types.get(base).map(String::as_str) == Some("histogram")).then_some(base)
            })
            .unwrap_or(name);
        assert!(
            help.contains(family) && types.contains_key(family),
            "{line:?}: no HELP and TYPE before it for {family}"
        );
        if name.ends_with("_bucket") && family != name {
            assert!(labels.contains_key("le"), "{line:?}: a bucket without le");
        }
        let key = (name.to_string(), labels);
        assert!(
            samples.insert(key, value).is_none(),
            "series twice: {line:?}"
        );
    }
    // Histograms: cumulative buckets, +Inf == _count.
    for ((name, labels), &v) in &samples {
        let Some(base) = name.strip_suffix("_count") else {
            continue;
        };
        if types.get(base).map(String::as_str) != Some("histogram") {
            continue;
        }
        let mut buckets: Vec<(f64, f64)> = samples
            .iter()
            .filter(|((n, l), _)| {
                n == &format!("{base}_bucket") && {
                    let mut l = l.clone();
                    l.remove("le");
                    &l == labels
                }
            })
            .map(|((_, l), &c)| {
                let le = &l["le"];
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().unwrap()
                };
                (le, c)
            })
            .collect();
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert!(
            buckets.windows(2).all(|w| w[0].1 <= w[1].1),
            "{base} {labels:?}"
        );
        assert_eq!(
            buckets.last(),
            Some(&(f64::INFINITY, v)),
            "{base} {labels:?}"
        );
    }
    samples
}

/// `a="x",b="y\"z"` → the labels, escapes undone.
fn parse_labels(body: &str, line: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut rest = body;
    while !rest.is_empty() {
        let (name, after) = rest.split_once("=\"").expect(line);
        let mut value = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next().expect(line) {
                (i, '"') => break i,
                (_, '\\') => match chars.next().expect(line).1 {
                    'n' => value.push('\n'),
                    c @ ('\\' | '"') => value.push(c),
                    c => panic!("escape \\{c} in {line:?}"),
                },
                (_, c) => value.push(c),
            }
        };
        assert!(out.insert(name.to_string(), value).is_none(), "{line:?}");
        rest = &after[end + 1..];
        rest = rest.strip_prefix(',').unwrap_or(rest);
    }
    out
}

/// The value of `name` with exactly these labels, or 0 where it is absent.
fn value(m: &BTreeMap<Series, f64>, name: &str, labels: &[(&str, &str)]) -> f64 {
    let labels = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    m.get(&(name.to_string(), labels)).copied().unwrap_or(0.0)
}

/// The open connections' ids, from their series.
fn connection_ids(m: &BTreeMap<Series, f64>) -> BTreeSet<String> {
    m.keys()
        .filter(|(n, _)| n.starts_with("qpip_nbd_connection_"))
        .map(|(_, l)| l["connection"].clone())
        .collect()
}

#[test]
fn scraped_during_fio_the_figures_match_fios_counts() {
    if !require(&["fio"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (mut srv, addr) = server_with_metrics(dir.path(), &["--metrics", "127.0.0.1:0"]);
    let before = parse_exposition(&scrape(&addr));
    assert!(connection_ids(&before).is_empty(), "{before:?}");
    assert_eq!(
        value(&before, "qpip_nbd_connections", &[("export", "a")]),
        0.0
    );
    let json = dir.path().join("fio.json");
    let mut fio = Command::new("fio")
        .args([
            "--name=metrics",
            "--ioengine=nbd",
            &format!("--uri={}", srv.uri("a")),
            "--rw=randrw",
            "--bsrange=4k-64k",
            "--size=32M",
            "--iodepth=8",
            "--numjobs=2",
            "--time_based",
            "--runtime=3",
            "--randseed=99",
            "--output-format=json",
            &format!("--output={}", json.display()),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting fio");
    // While fio runs: its two connections each have series, labelled by id and peer.
    let deadline = Instant::now() + Duration::from_secs(20);
    let during = loop {
        let m = parse_exposition(&scrape(&addr));
        if connection_ids(&m).len() == 2
            && value(
                &m,
                "qpip_nbd_export_requests_total",
                &[("export", "a"), ("command", "write")],
            ) > 0.0
        {
            break m;
        }
        assert!(Instant::now() < deadline, "fio's connections never showed");
        assert!(
            fio.try_wait().unwrap().is_none(),
            "fio ended before a scrape saw it"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        value(&during, "qpip_nbd_connections", &[("export", "a")]),
        2.0
    );
    let peers: BTreeSet<&str> = during
        .keys()
        .filter(|(n, _)| n == "qpip_nbd_connection_requests_total")
        .map(|(_, l)| l["peer"].as_str())
        .collect();
    assert!(
        peers.iter().all(|p| p.starts_with("127.0.0.1:")),
        "{peers:?}"
    );
    let status = fio.wait().unwrap();
    let mut err = String::new();
    fio.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(status.success(), "fio failed: {err}");
    // fio's own counts, summed over its jobs.
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let sum = |dir: &str, field: &str| -> f64 {
        report["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j[dir][field].as_u64().unwrap() as f64)
            .sum()
    };
    // Once fio's connections have ended their series go; the export keeps their figures.
    let deadline = Instant::now() + Duration::from_secs(20);
    let after = loop {
        let m = parse_exposition(&scrape(&addr));
        if connection_ids(&m).is_empty() {
            break m;
        }
        assert!(Instant::now() < deadline, "connection series stayed: {m:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let a = |name: &str, labels: &[(&str, &str)]| {
        let mut l = vec![("export", "a")];
        l.extend_from_slice(labels);
        value(&after, name, &l)
    };
    let requests = "qpip_nbd_export_requests_total";
    assert!(sum("read", "total_ios") > 0.0 && sum("write", "total_ios") > 0.0);
    assert_eq!(
        a(requests, &[("command", "read")]),
        sum("read", "total_ios")
    );
    assert_eq!(
        a(requests, &[("command", "write")]),
        sum("write", "total_ios")
    );
    assert_eq!(
        a("qpip_nbd_export_read_bytes_total", &[]),
        sum("read", "io_bytes")
    );
    assert_eq!(
        a("qpip_nbd_export_written_bytes_total", &[]),
        sum("write", "io_bytes")
    );
    let duration = "qpip_nbd_export_request_duration_seconds_count";
    assert_eq!(
        a(duration, &[("command", "read")]),
        sum("read", "total_ios")
    );
    assert_eq!(
        a(duration, &[("command", "write")]),
        sum("write", "total_ios")
    );
    assert_eq!(a("qpip_nbd_export_in_flight", &[]), 0.0);
    assert_eq!(a("qpip_nbd_connections", &[]), 0.0);
    // fio also connects once per job to learn the size, before its I/O connections.
    let opened = a("qpip_nbd_connections_opened_total", &[]);
    assert!(opened >= 2.0, "{opened}");
    let completed = ("result", "completed");
    assert_eq!(
        value(&after, "qpip_nbd_handshakes_total", &[completed]),
        opened
    );
    let errors: f64 = (after.iter())
        .filter(|((n, _), _)| n == "qpip_nbd_export_errors_total")
        .map(|(_, v)| v)
        .sum();
    assert_eq!(errors, 0.0);
    srv.assert_alive("after the scrapes");
}

#[test]
fn errors_are_counted_by_errno_on_a_unix_socket_from_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("metrics.sock");
    let config = dir.path().join("server.toml");
    std::fs::write(&config, format!("metrics = \"unix:{}\"\n", sock.display())).unwrap();
    let (srv, addr) = server_with_metrics(
        dir.path(),
        &["--read-only", "--config", config.to_str().unwrap()],
    );
    assert_eq!(addr, format!("unix:{}", sock.display()));
    // A write to a read-only export: EPERM (the nbd crate sends it; qemu-io would not).
    let mut tcp = TcpStream::connect(srv.addr).unwrap();
    let export = handshake(&mut tcp, b"a").unwrap();
    let mut c = NbdClient::new(tcp, &export);
    assert!(c.write_all(&[1; 4096]).and_then(|()| c.flush()).is_err());
    drop(c);
    let m = parse_exposition(&scrape(&addr));
    let e = |errno| {
        value(
            &m,
            "qpip_nbd_export_errors_total",
            &[("export", "a"), ("errno", errno)],
        )
    };
    assert_eq!(e("EPERM"), 1.0);
    assert_eq!(e("EIO"), 0.0);
    assert_eq!(
        value(
            &m,
            "qpip_nbd_export_written_bytes_total",
            &[("export", "a")]
        ),
        0.0
    );
    drop(srv);
}

#[test]
fn garbage_and_slow_clients_on_the_metrics_port_do_not_disturb_serving() {
    if !require(&["qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (mut srv, addr) = server_with_metrics(dir.path(), &["--metrics", "127.0.0.1:0"]);
    // Slowloris: more clients than the listener answers at once, a byte every 100 ms.
    let slow: Vec<_> = (0..8)
        .map(|_| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(&addr).unwrap();
                s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
                let start = Instant::now();
                for b in b"GET /metrics HTTP/1.1\r\nX-Slow: ".iter().cycle() {
                    if s.write_all(&[*b]).is_err() || start.elapsed() > Duration::from_secs(20) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                // Cut off well before 20 s: an error answer or a close.
                let mut rest = Vec::new();
                let _ = s.read_to_end(&mut rest);
                start.elapsed()
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    // NBD is served meanwhile.
    qemu_io(&srv.uri("a"), &["write -P 7 0 1M", "read -P 7 0 1M"]);
    for slow in slow {
        let took = slow.join().unwrap();
        assert!(
            took < Duration::from_secs(15),
            "a slow client held on for {took:?}"
        );
    }
    // Garbage: each gets an error answer (or is closed), never a crash.
    let big = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(20_000));
    let cases: [(&[u8], &str); 6] = [
        (b"\x00\xff\xfe\xfdgarbage\r\n\r\n", "400"),
        (b"GET /metrics\r\n\r\n", "400"),
        (b"DELETE /metrics HTTP/1.1\r\n\r\n", "405"),
        (b"GET /other HTTP/1.1\r\n\r\n", "404"),
        (big.as_bytes(), "431"),
        (b"GET /metrics HTTP/1.1\n\n", "200"),
    ];
    for (req, code) in cases {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let _ = s.write_all(req); // the server may close before reading it all
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let answer = String::from_utf8_lossy(&out);
        // The oversized head is closed on with bytes unread: the answer may be lost to
        // the reset.
        let reset = code == "431" && answer.is_empty();
        assert!(
            reset || answer.starts_with(&format!("HTTP/1.1 {code} ")),
            "{:?}: {answer:?}",
            String::from_utf8_lossy(&req[..req.len().min(40)])
        );
    }
    // Clients that connect and leave.
    for _ in 0..20 {
        drop(TcpStream::connect(&addr).unwrap());
    }
    srv.assert_alive("after garbage on the metrics port");
    qemu_io(&srv.uri("a"), &["read -P 7 0 1M"]);
    let m = parse_exposition(&scrape(&addr));
    assert_eq!(
        value(
            &m,
            "qpip_nbd_export_written_bytes_total",
            &[("export", "a")]
        ),
        MIB as f64
    );
    assert_eq!(
        value(&m, "qpip_nbd_export_read_bytes_total", &[("export", "a")]),
        2.0 * MIB as f64
    );
}
