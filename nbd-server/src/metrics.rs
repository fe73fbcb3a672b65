//! Live statistics: what each connection and export has done, counted while it serves, and
//! their text in Prometheus' exposition format (version 0.0.4).
//!
//! Counting is on the data path, so it costs a few relaxed atomic additions per request on
//! counters the connection's own thread writes (`ConnStats`: no lock, no allocation; a
//! latency histogram is a fixed array of buckets) and one clock read at the reply (the
//! arrival time is the one the connection reads already for its idle timeout). Locks are
//! taken only when a connection starts or ends and when a snapshot is taken.
//!
//! [`Registry::snapshot`] copies the figures into plain data ([`Snapshot`]); [`render`] turns
//! a snapshot into text, with no I/O: the binary serves it over HTTP.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use nbd_proto::transmission::{Command, ErrorValue};
use parking_lot::Mutex;

/// The commands counted, by their label; the last counts any other.
pub const COMMANDS: [&str; 10] = [
    "read",
    "write",
    "disc",
    "flush",
    "trim",
    "cache",
    "write_zeroes",
    "block_status",
    "resize",
    "other",
];
const DISC: usize = 2;

/// The errors replied, by their label; the last counts any other.
pub const ERRNOS: [&str; 9] = [
    "EPERM",
    "EIO",
    "ENOMEM",
    "EINVAL",
    "ENOSPC",
    "EOVERFLOW",
    "ENOTSUP",
    "ESHUTDOWN",
    "other",
];

/// Handshake outcomes, by their label.
pub const HANDSHAKES: [&str; 4] = ["completed", "failed", "abandoned", "refused"];

/// How a handshake ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handshake {
    /// The client reached the transmission phase.
    Completed = 0,
    /// A protocol or TLS error.
    Failed = 1,
    /// The client left (or was dropped) before choosing an export.
    Abandoned = 2,
    /// Refused past the handshake: --max-connections reached.
    Refused = 3,
}

/// Upper bounds of the latency buckets in nanoseconds (`le`); one more bucket, +Inf, follows.
pub const LATENCY_BOUNDS_NS: [u64; 18] = [
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    10_000_000_000,
];
const BUCKETS: usize = LATENCY_BOUNDS_NS.len() + 1;

fn command_index(c: Command) -> usize {
    match c {
        Command::Read => 0,
        Command::Write => 1,
        Command::Disc => DISC,
        Command::Flush => 3,
        Command::Trim => 4,
        Command::Cache => 5,
        Command::WriteZeroes => 6,
        Command::BlockStatus => 7,
        Command::Resize => 8,
        _ => 9,
    }
}

fn errno_index(e: ErrorValue) -> usize {
    match e {
        ErrorValue::Perm => 0,
        ErrorValue::Io => 1,
        ErrorValue::NoMem => 2,
        ErrorValue::Inval => 3,
        ErrorValue::NoSpc => 4,
        ErrorValue::Overflow => 5,
        ErrorValue::NotSup => 6,
        ErrorValue::Shutdown => 7,
        _ => 8,
    }
}

/// A request being served: what its reply adds to the figures.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Started {
    command: usize,
    at: Instant,
    /// The bytes a successful READ or WRITE moves; 0 for the other commands.
    len: u64,
}

impl Started {
    /// With the bytes a READ or WRITE of `len` bytes moves when it succeeds.
    pub(crate) fn moving(mut self, len: u64) -> Started {
        self.len = len;
        self
    }
}

#[derive(Default)]
struct Histogram {
    /// Observations per bucket (not cumulative).
    buckets: [AtomicU64; BUCKETS],
    sum_ns: AtomicU64,
}

/// Counters of requests, bytes, errors and latencies.
#[derive(Default)]
struct Counters {
    requests: [AtomicU64; COMMANDS.len()],
    errors: [AtomicU64; ERRNOS.len()],
    read_bytes: AtomicU64,
    written_bytes: AtomicU64,
    latency: [Histogram; COMMANDS.len()],
}

impl Counters {
    fn add_to(&self, to: &mut Counts) {
        let add = |t: &mut u64, a: &AtomicU64| *t += a.load(Relaxed);
        for (t, a) in to.requests.iter_mut().zip(&self.requests) {
            add(t, a);
        }
        for (t, a) in to.errors.iter_mut().zip(&self.errors) {
            add(t, a);
        }
        add(&mut to.read_bytes, &self.read_bytes);
        add(&mut to.written_bytes, &self.written_bytes);
        for (t, h) in to.latency.iter_mut().zip(&self.latency) {
            for (b, a) in t.buckets.iter_mut().zip(&h.buckets) {
                add(b, a);
            }
            add(&mut t.sum_ns, &h.sum_ns);
        }
    }

    /// Adds `c`'s figures to these (a connection's, when it ends, to its export's).
    fn absorb(&self, c: &Counts) {
        let add = |a: &AtomicU64, v: u64| {
            a.fetch_add(v, Relaxed);
        };
        for (a, &v) in self.requests.iter().zip(&c.requests) {
            add(a, v);
        }
        for (a, &v) in self.errors.iter().zip(&c.errors) {
            add(a, v);
        }
        add(&self.read_bytes, c.read_bytes);
        add(&self.written_bytes, c.written_bytes);
        for (h, t) in self.latency.iter().zip(&c.latency) {
            for (a, &v) in h.buckets.iter().zip(&t.buckets) {
                add(a, v);
            }
            add(&h.sum_ns, t.sum_ns);
        }
    }
}

/// One connection's figures, written by its thread only.
pub(crate) struct ConnStats {
    id: u64,
    peer: String,
    counters: Counters,
    in_flight: AtomicU64,
}

/// Adds one to a counter only this thread writes: a load and a store, no locked
/// read-modify-write on the data path (readers may see it a moment late).
fn bump(a: &AtomicU64, by: u64) {
    a.store(a.load(Relaxed).wrapping_add(by), Relaxed);
}

impl ConnStats {
    /// A request arrived at `at` (its command parsed, or refused).
    pub(crate) fn request(&self, command: Command, at: Instant) -> Started {
        let command = command_index(command);
        bump(&self.counters.requests[command], 1);
        // DISC has no reply.
        if command != DISC {
            bump(&self.in_flight, 1);
        }
        Started {
            command,
            at,
            len: 0,
        }
    }

    /// The reply to `started` was posted, with `error` or success.
    pub(crate) fn replied(&self, started: Started, error: Option<ErrorValue>) {
        let ns = u64::try_from(started.at.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let h = &self.counters.latency[started.command];
        bump(
            &h.buckets[LATENCY_BOUNDS_NS.partition_point(|&b| b < ns)],
            1,
        );
        bump(&h.sum_ns, ns);
        bump(&self.in_flight, u64::MAX); // minus one
        match error {
            Some(e) => bump(&self.counters.errors[errno_index(e)], 1),
            None if started.command == 0 => bump(&self.counters.read_bytes, started.len),
            None if started.command == 1 => bump(&self.counters.written_bytes, started.len),
            None => {}
        }
    }
}

/// An export's figures: those of its open connections, and the sum of those that ended.
#[derive(Default)]
pub struct ExportStats {
    ended: Counters,
    opened: AtomicU64,
    open: Mutex<Vec<Arc<ConnStats>>>,
}

impl ExportStats {
    /// Counts a connection on this export until the returned guard is dropped.
    pub(crate) fn attach(&self, id: u64, peer: String) -> Attached<'_> {
        let conn = Arc::new(ConnStats {
            id,
            peer,
            counters: Counters::default(),
            in_flight: AtomicU64::new(0),
        });
        self.opened.fetch_add(1, Relaxed);
        self.open.lock().push(conn.clone());
        Attached { export: self, conn }
    }
}

/// A connection counted on its export; dropped when it ends, its figures going into the
/// export's (under the lock a snapshot takes, so that no snapshot counts them twice or
/// misses them).
pub(crate) struct Attached<'a> {
    export: &'a ExportStats,
    pub conn: Arc<ConnStats>,
}

impl Drop for Attached<'_> {
    fn drop(&mut self) {
        let mut open = self.export.open.lock();
        let mut counts = Counts::default();
        self.conn.counters.add_to(&mut counts);
        self.export.ended.absorb(&counts);
        open.retain(|c| !Arc::ptr_eq(c, &self.conn));
    }
}

/// The server's figures that belong to no export.
#[derive(Default)]
pub struct Registry {
    handshakes: [AtomicU64; HANDSHAKES.len()],
    next_id: AtomicU64,
}

impl Registry {
    pub(crate) fn handshake(&self, how: Handshake) {
        self.handshakes[how as usize].fetch_add(1, Relaxed);
    }

    /// A new connection's id (1, 2, ...).
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Relaxed) + 1
    }

    /// The figures now, of the server and of `exports` (name and figures).
    pub fn snapshot<'a>(
        &self,
        exports: impl IntoIterator<Item = (&'a str, &'a ExportStats)>,
    ) -> Snapshot {
        let exports = exports
            .into_iter()
            .map(|(name, s)| {
                let open = s.open.lock();
                let mut totals = Counts::default();
                s.ended.add_to(&mut totals);
                let mut in_flight = 0;
                let connections = open
                    .iter()
                    .map(|c| {
                        let mut counts = Counts::default();
                        c.counters.add_to(&mut counts);
                        c.counters.add_to(&mut totals);
                        let f = c.in_flight.load(Relaxed);
                        in_flight += f;
                        ConnSnapshot {
                            id: c.id,
                            peer: c.peer.clone(),
                            counts,
                            in_flight: f,
                        }
                    })
                    .collect();
                ExportSnapshot {
                    name: name.to_string(),
                    totals,
                    in_flight,
                    opened: s.opened.load(Relaxed),
                    connections,
                }
            })
            .collect();
        Snapshot {
            handshakes: self.handshakes.each_ref().map(|a| a.load(Relaxed)),
            exports,
        }
    }
}

/// A latency histogram's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HistogramCounts {
    /// Observations per bucket, not cumulative: bucket i up to `LATENCY_BOUNDS_NS[i]`, the
    /// last one above them all.
    pub buckets: [u64; BUCKETS],
    /// Sum of the observations, in nanoseconds.
    pub sum_ns: u64,
}

/// Requests, errors, bytes and latencies, as numbers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Requests received, by command ([`COMMANDS`]).
    pub requests: [u64; COMMANDS.len()],
    /// Error replies, by error ([`ERRNOS`]).
    pub errors: [u64; ERRNOS.len()],
    /// Bytes read by successful READs.
    pub read_bytes: u64,
    /// Bytes written by successful WRITEs.
    pub written_bytes: u64,
    /// Time from a request's arrival to its reply, by command.
    pub latency: [HistogramCounts; COMMANDS.len()],
}

/// An open connection's figures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnSnapshot {
    /// The connection's id, unique in the server's run.
    pub id: u64,
    /// The client's address.
    pub peer: String,
    /// What it did.
    pub counts: Counts,
    /// Requests received and not replied to yet.
    pub in_flight: u64,
}

/// An export's figures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportSnapshot {
    /// The export's name.
    pub name: String,
    /// Its connections' figures, those that ended included.
    pub totals: Counts,
    /// Requests in flight on its open connections.
    pub in_flight: u64,
    /// Connections opened on it since the start.
    pub opened: u64,
    /// Its open connections.
    pub connections: Vec<ConnSnapshot>,
}

/// The server's figures at one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    /// Handshakes, by outcome ([`HANDSHAKES`]).
    pub handshakes: [u64; HANDSHAKES.len()],
    /// Every export, in the server's order.
    pub exports: Vec<ExportSnapshot>,
}

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A label value with `\`, `"` and newlines escaped, as the format asks.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// Seconds from nanoseconds, as the text shows them (`0.00025`).
fn seconds(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// Starts a metric family: its HELP and TYPE lines.
fn family(text: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(
        text,
        "# HELP qpip_nbd_{name} {help}\n# TYPE qpip_nbd_{name} {kind}"
    );
}

/// Text in Prometheus' exposition format: every metric family with its HELP and TYPE, an
/// export's series labelled `export`, an open connection's also `connection` (its id) and
/// `peer`.
pub fn render(s: &Snapshot) -> String {
    let mut text = String::new();
    let t = &mut text;
    family(
        t,
        "handshakes_total",
        "counter",
        "NBD handshakes by outcome (refused: --max-connections reached).",
    );
    for (label, n) in HANDSHAKES.iter().zip(s.handshakes) {
        let _ = writeln!(t, "qpip_nbd_handshakes_total{{result=\"{label}\"}} {n}");
    }
    let exports: Vec<(String, &ExportSnapshot)> = (s.exports.iter())
        .map(|e| (format!("export=\"{}\"", escape(&e.name)), e))
        .collect();
    family(
        t,
        "connections",
        "gauge",
        "Open connections (past the handshake).",
    );
    for (l, e) in &exports {
        let _ = writeln!(t, "qpip_nbd_connections{{{l}}} {}", e.connections.len());
    }
    let name = "connections_opened_total";
    family(
        t,
        name,
        "counter",
        "Connections that reached the transmission phase.",
    );
    for (l, e) in &exports {
        let _ = writeln!(t, "qpip_nbd_{name}{{{l}}} {}", e.opened);
    }
    let series: Vec<(&str, &Counts, u64)> = (exports.iter())
        .map(|(l, e)| (l.as_str(), &e.totals, e.in_flight))
        .collect();
    counts(
        t,
        "export",
        "the export's connections, ended ones included",
        &series,
    );
    let labels: Vec<(String, &ConnSnapshot)> = (exports.iter())
        .flat_map(|(l, e)| {
            e.connections.iter().map(move |c| {
                let peer = escape(&c.peer);
                (format!("{l},connection=\"{}\",peer=\"{peer}\"", c.id), c)
            })
        })
        .collect();
    let series: Vec<(&str, &Counts, u64)> = (labels.iter())
        .map(|(l, c)| (l.as_str(), &c.counts, c.in_flight))
        .collect();
    counts(t, "connection", "the connection", &series);
    text
}

/// The families of [`Counts`] and the in-flight depth of `series` (labels, figures, depth),
/// for `scope` ("export" or "connection").
fn counts(t: &mut String, scope: &str, what: &str, series: &[(&str, &Counts, u64)]) {
    let name = format!("{scope}_requests_total");
    family(
        t,
        &name,
        "counter",
        &format!("Requests received on {what}, by command."),
    );
    for (l, c, _) in series {
        for (cmd, n) in COMMANDS.iter().zip(c.requests) {
            let _ = writeln!(t, "qpip_nbd_{name}{{{l},command=\"{cmd}\"}} {n}");
        }
    }
    let name = format!("{scope}_errors_total");
    family(
        t,
        &name,
        "counter",
        &format!("Error replies on {what}, by NBD error."),
    );
    for (l, c, _) in series {
        for (errno, n) in ERRNOS.iter().zip(c.errors) {
            let _ = writeln!(t, "qpip_nbd_{name}{{{l},errno=\"{errno}\"}} {n}");
        }
    }
    let name = format!("{scope}_read_bytes_total");
    family(
        t,
        &name,
        "counter",
        &format!("Bytes read by successful READs on {what}."),
    );
    for (l, c, _) in series {
        let _ = writeln!(t, "qpip_nbd_{name}{{{l}}} {}", c.read_bytes);
    }
    let name = format!("{scope}_written_bytes_total");
    family(
        t,
        &name,
        "counter",
        &format!("Bytes written by successful WRITEs on {what}."),
    );
    for (l, c, _) in series {
        let _ = writeln!(t, "qpip_nbd_{name}{{{l}}} {}", c.written_bytes);
    }
    let name = format!("{scope}_in_flight");
    let help = format!("Requests received and not yet replied to on {what}.");
    family(t, &name, "gauge", &help);
    for (l, _, n) in series {
        let _ = writeln!(t, "qpip_nbd_{name}{{{l}}} {n}");
    }
    let name = format!("{scope}_request_duration_seconds");
    let help = format!(
        "Time from a request's arrival to its reply on {what}, by command (the commands seen)."
    );
    family(t, &name, "histogram", &help);
    for (l, c, _) in series {
        for (cmd, h) in COMMANDS.iter().zip(&c.latency) {
            let count: u64 = h.buckets.iter().sum();
            if count == 0 {
                continue;
            }
            let mut cumulative = 0;
            for (i, n) in h.buckets.iter().enumerate() {
                cumulative += n;
                let le = match LATENCY_BOUNDS_NS.get(i) {
                    Some(&b) => seconds(b).to_string(),
                    None => "+Inf".into(),
                };
                let _ = writeln!(
                    t,
                    "qpip_nbd_{name}_bucket{{{l},command=\"{cmd}\",le=\"{le}\"}} {cumulative}"
                );
            }
            let sum = seconds(h.sum_ns);
            let _ = writeln!(t, "qpip_nbd_{name}_sum{{{l},command=\"{cmd}\"}} {sum}");
            let _ = writeln!(t, "qpip_nbd_{name}_count{{{l},command=\"{cmd}\"}} {count}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn_stats(id: u64, peer: &str) -> ConnStats {
        ConnStats {
            id,
            peer: peer.into(),
            counters: Counters::default(),
            in_flight: AtomicU64::new(0),
        }
    }

    #[test]
    fn replies_count_requests_bytes_errors_and_latency() {
        let c = conn_stats(1, "p");
        let t0 = Instant::now();
        let r = c.request(Command::Read, t0).moving(4096);
        let w = c.request(Command::Write, t0).moving(512);
        let f = c.request(Command::Flush, t0);
        c.request(Command::Disc, t0);
        assert_eq!(c.in_flight.load(Relaxed), 3);
        c.replied(r, None);
        c.replied(w, Some(ErrorValue::NoSpc));
        c.replied(f, None);
        assert_eq!(c.in_flight.load(Relaxed), 0);
        let mut n = Counts::default();
        c.counters.add_to(&mut n);
        assert_eq!(n.requests[..4], [1, 1, 1, 1]);
        assert_eq!((n.read_bytes, n.written_bytes), (4096, 0));
        assert_eq!(n.errors[4], 1, "ENOSPC");
        assert_eq!(n.errors.iter().sum::<u64>(), 1);
        let observed: u64 = n.latency.iter().flat_map(|h| h.buckets).sum();
        assert_eq!(observed, 3, "DISC has no reply");
    }

    #[test]
    fn an_ended_connection_leaves_its_figures_to_the_export() {
        let registry = Registry::default();
        let export = ExportStats::default();
        let a = export.attach(registry.next_id(), "127.0.0.1:1".into());
        let b = export.attach(registry.next_id(), "[::1]:2".into());
        let r = a.conn.request(Command::Read, Instant::now()).moving(10);
        a.conn.replied(r, None);
        b.conn.request(Command::Write, Instant::now());
        let s = registry.snapshot([("e", &export)]);
        let e = &s.exports[0];
        assert_eq!(e.connections.len(), 2);
        assert_eq!((e.connections[0].id, e.connections[1].id), (1, 2));
        assert_eq!(
            (e.totals.read_bytes, e.totals.requests[1], e.in_flight),
            (10, 1, 1)
        );
        drop(a);
        let s = registry.snapshot([("e", &export)]);
        let e = &s.exports[0];
        assert_eq!(e.connections.len(), 1);
        assert_eq!(e.connections[0].peer, "[::1]:2");
        assert_eq!(
            (e.totals.read_bytes, e.totals.requests[0], e.opened),
            (10, 1, 2)
        );
        drop(b);
        let s = registry.snapshot([("e", &export)]);
        assert!(s.exports[0].connections.is_empty());
        assert_eq!(s.exports[0].totals.requests[..2], [1, 1]);
    }

    #[test]
    fn latencies_fall_in_the_bucket_of_their_bound() {
        let c = conn_stats(1, "p");
        let now = Instant::now();
        let at = |ago_ns: u64| {
            now.checked_sub(std::time::Duration::from_nanos(ago_ns))
                .unwrap()
        };
        c.replied(c.request(Command::Trim, at(20_000_000_000)), None); // above every bound
        let mut n = Counts::default();
        c.counters.add_to(&mut n);
        assert_eq!(n.latency[4].buckets[BUCKETS - 1], 1);
        assert!(n.latency[4].sum_ns >= 20_000_000_000);
    }

    fn sample() -> Snapshot {
        let mut totals = Counts::default();
        totals.requests[0] = 3;
        totals.errors[1] = 2;
        totals.read_bytes = 12288;
        totals.latency[0].buckets[0] = 1;
        totals.latency[0].buckets[3] = 2;
        totals.latency[0].sum_ns = 150_000;
        let mut counts = Counts::default();
        counts.requests[1] = 1;
        Snapshot {
            handshakes: [4, 1, 0, 0],
            exports: vec![ExportSnapshot {
                name: "d\"i\\sk\n".into(),
                totals,
                in_flight: 1,
                opened: 3,
                connections: vec![ConnSnapshot {
                    id: 7,
                    peer: "[::1]:4000".into(),
                    counts,
                    in_flight: 1,
                }],
            }],
        }
    }

    #[test]
    fn the_text_has_every_family_typed_and_its_series_labelled() {
        let text = render(&sample());
        let mut typed = std::collections::HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                typed.insert(rest.split(' ').next().unwrap().to_string());
                continue;
            }
            if line.starts_with("# HELP ") {
                continue;
            }
            let name = line.split(['{', ' ']).next().unwrap();
            let family = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|b| b.ends_with("_seconds")))
                .unwrap_or(name);
            assert!(typed.contains(family), "{line}: no TYPE for {family}");
            let value = line.rsplit(' ').next().unwrap();
            assert!(value.parse::<f64>().is_ok(), "{line}");
        }
        let e = r#"export="d\"i\\sk\n""#;
        for want in [
            "# TYPE qpip_nbd_handshakes_total counter",
            "qpip_nbd_handshakes_total{result=\"completed\"} 4",
            &format!("qpip_nbd_connections{{{e}}} 1"),
            &format!("qpip_nbd_connections_opened_total{{{e}}} 3"),
            &format!("qpip_nbd_export_requests_total{{{e},command=\"read\"}} 3"),
            &format!("qpip_nbd_export_errors_total{{{e},errno=\"EIO\"}} 2"),
            &format!("qpip_nbd_export_read_bytes_total{{{e}}} 12288"),
            &format!("qpip_nbd_export_in_flight{{{e}}} 1"),
            "# TYPE qpip_nbd_export_request_duration_seconds histogram",
            &format!(
                "qpip_nbd_export_request_duration_seconds_bucket{{{e},command=\"read\",le=\"0.00001\"}} 1"
            ),
            &format!(
                "qpip_nbd_export_request_duration_seconds_bucket{{{e},command=\"read\",le=\"0.00005\"}} 1"
            ),
            &format!(
                "qpip_nbd_export_request_duration_seconds_bucket{{{e},command=\"read\",le=\"0.0001\"}} 3"
            ),
            &format!(
                "qpip_nbd_export_request_duration_seconds_bucket{{{e},command=\"read\",le=\"+Inf\"}} 3"
            ),
            &format!(
                "qpip_nbd_export_request_duration_seconds_sum{{{e},command=\"read\"}} 0.00015"
            ),
            &format!("qpip_nbd_export_request_duration_seconds_count{{{e},command=\"read\"}} 3"),
            &format!(
                "qpip_nbd_connection_requests_total{{{e},connection=\"7\",peer=\"[::1]:4000\",command=\"write\"}} 1"
            ),
            &format!("qpip_nbd_connection_in_flight{{{e},connection=\"7\",peer=\"[::1]:4000\"}} 1"),
        ] {
            assert!(
                text.lines().any(|l| l == want),
                "missing {want:?} in\n{text}"
            );
        }
        // Histograms only for the commands seen.
        assert!(!text.contains("command=\"write\",le="), "{text}");
    }
}
