//! The storage experiment's programs in virtual time: their mechanics, never a figure.

use std::net::SocketAddr;

use super::experiments::{self, Setup};
use super::nbd::{NbdClient, NbdConfig, NbdDir, NbdPort, NbdServer, ReplyRecv};
use super::{Nanos, Sim};

/// Runs `cfg`; returns (sim, client, server).
fn run(setup: &Setup, cfg: NbdConfig) -> (Sim, usize, usize) {
    let (mut sim, s, c) = experiments::pair(setup).unwrap();
    let addr = setup.fabric.node("server").unwrap().addr;
    let server = SocketAddr::new(addr.into(), cfg.tcp_port);
    sim.set_app(s, Box::new(NbdServer::new(cfg)));
    sim.set_app(c, Box::new(NbdClient::new(cfg, server)));
    sim.run(experiments::LIMIT).unwrap();
    (sim, c, s)
}

fn small(dir: NbdDir, requests: u64) -> NbdConfig {
    let cfg = NbdConfig::as_ported(dir, 0);
    NbdConfig {
        total: requests * cfg.request_bytes as u64,
        ..cfg
    }
}

fn port(dir: NbdDir, f: impl FnOnce(&mut NbdPort)) -> NbdPort {
    let mut p = NbdPort::as_ported(dir);
    f(&mut p);
    p
}

fn client(sim: &Sim, c: usize) -> &NbdClient {
    sim.app::<NbdClient>(c).unwrap()
}

fn elapsed(sim: &Sim, c: usize) -> Nanos {
    let cl = client(sim, c);
    cl.finished_at().unwrap() - cl.started_at().unwrap()
}

#[test]
fn a_client_with_one_request_outstanding_never_has_two_in_flight() {
    let setup = Setup::default();
    let (sim, c, _) = run(&setup, small(NbdDir::Read, 6));
    let cl = client(&sim, c);
    assert_eq!(cl.answered(), 6);
    assert_eq!(cl.max_in_flight(), 1);
    // Each request is sent only after the previous one's reply was handled.
    let st = cl.stamps();
    assert!(st.windows(2).all(|w| w[1].start >= w[0].end), "{st:?}");
    // Writes, as ported, hand over as many as the block layer's slots allow.
    let (sim, c, _) = run(&setup, small(NbdDir::Write, 12));
    assert!(client(&sim, c).max_in_flight() > 1);
    assert!(client(&sim, c).max_in_flight() <= NbdPort::as_ported(NbdDir::Write).depth);
}

#[test]
fn a_client_whose_sends_wait_has_one_send_outstanding() {
    let setup = Setup::default();
    let waits = small(NbdDir::Write, 12);
    let (sim, c, _) = run(&setup, waits);
    assert_eq!(client(&sim, c).max_sends_outstanding(), 1);
    let free = waits.with_port(port(NbdDir::Write, |p| p.send_waits = false));
    let (sim, c, _) = run(&setup, free);
    assert!(client(&sim, c).max_sends_outstanding() > 1);
}

#[test]
fn a_server_receive_posted_late_delays_the_next_request() {
    let setup = Setup::default();
    // nbd-server's one buffer: the next request is taken only once the previous reply's
    // send has completed (its receive is posted then), however many the client has sent.
    let sends_free = port(NbdDir::Write, |p| p.send_waits = false);
    let cfg = small(NbdDir::Write, 12).with_port(sends_free);
    let (sim, c, s) = run(&setup, cfg);
    let srv = sim.app::<NbdServer>(s).unwrap();
    let st = srv.stamps();
    assert_eq!(st.len(), 12);
    assert!(st.windows(2).all(|w| w[1].start >= w[0].end), "{st:?}");
    let one_slot = elapsed(&sim, c);
    // With receives posted ahead the server takes requests while replies are in flight.
    let ahead = NbdPort {
        server_slots: 4,
        ..sends_free
    };
    let (sim, c, s) = run(&setup, cfg.with_port(ahead));
    let st = sim.app::<NbdServer>(s).unwrap().stamps();
    assert!(st.windows(2).any(|w| w[1].start < w[0].end), "{st:?}");
    assert!(elapsed(&sim, c) <= one_slot);
}

#[test]
fn host_copies_cost_their_bytes() {
    let setup = Setup::default();
    let per_byte = setup.params.host.copy_ns_per_byte;
    let cfg = small(NbdDir::Read, 4);
    let busy = |cfg: NbdConfig| {
        let (sim, c, s) = run(&setup, cfg);
        (sim.host(c).busy_ns() as f64, sim.host(s).busy_ns() as f64)
    };
    let copy = cfg.total as f64 * per_byte;
    // The server's read() from its page cache, the client's copy out of its bounce buffer.
    let (c0, s0) = busy(cfg);
    let (c1, s1) = busy(cfg.with_port(port(NbdDir::Read, |p| p.server_copies = false)));
    assert!((s0 - s1 - copy).abs() <= 4.0, "{s0} {s1} {copy}");
    assert_eq!(c0, c1);
    let direct = port(NbdDir::Read, |p| p.reply_recv = ReplyRecv::Direct);
    let (c2, s2) = busy(cfg.with_port(direct));
    assert!((c0 - c2 - copy).abs() <= 4.0, "{c0} {c2} {copy}");
    assert_eq!(s0, s2);
}

#[test]
fn every_port_moves_every_byte() {
    let setup = Setup::default();
    for dir in [NbdDir::Read, NbdDir::Write] {
        for (waits, recv, slots) in [
            (true, ReplyRecv::Bounce, 1),
            (false, ReplyRecv::Direct, 4),
            (false, ReplyRecv::Bounce, 2),
        ] {
            let p = port(dir, |p| {
                p.depth = 8;
                p.send_waits = waits;
                p.reply_recv = recv;
                p.server_slots = slots;
            });
            let cfg = NbdConfig {
                total: 5 * 20_000 + 123,
                request_bytes: 20_000,
                ..small(dir, 1).with_port(p)
            };
            let r = experiments::nbd(&setup, cfg).unwrap();
            assert_eq!(r.bytes, cfg.total);
            assert!(r.max_in_flight <= 8);
        }
    }
}
