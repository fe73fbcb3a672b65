//! The lanai backend in real time: NICs on nodes of a private emulated fabric, in one
//! process; and (as root) the TUN bridge between the kernel and the fabric.

mod common;
mod lanai_common;

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::wait_n;
use lanai_common::*;
use qpip_core::lanai::bridge::Bridge;
use qpip_core::lanai::frame;
use qpip_core::{Access, Nic, NicChoice, Opcode, QpAttr, RecvWr, SendWr, WcStatus};

const T: Duration = Duration::from_secs(30);

fn nic(fabric: &TestFabric, node: &str) -> Nic {
    Nic::open(NicChoice::Lanai(fabric.config(node))).expect("opening a lanai NIC")
}

/// Two NICs on different nodes: connect/accept, messages both ways, intact and in order.
#[test]
fn two_nodes_connect_and_exchange_messages() {
    let fabric = test_fabric();
    let (a, b) = (nic(&fabric, "server"), nic(&fabric, "client"));
    assert_eq!((a.backend_name(), a.io_path()), ("lanai", "firmware"));
    let (cq_a, cq_b) = (a.create_cq(64), b.create_cq(64));
    let listener = a.listen(sock(&fabric, "server", 7000)).unwrap();
    assert_eq!(listener.local_addr(), sock(&fabric, "server", 7000));
    let server = a.create_qp(QpAttr::new(&cq_a));
    let client = b.create_qp(QpAttr::new(&cq_b));
    client.connect_timeout(listener.local_addr(), T).unwrap();
    let peer = listener.accept_timeout(&server, T).unwrap();
    assert_eq!(peer.ip(), fabric.addr("client"));

    const SLOT: usize = 256 * 1024;
    let (mr_a, mr_b) = (
        a.alloc_region(8 * SLOT, Access::READ_WRITE),
        b.alloc_region(SLOT + 4096, Access::READ_WRITE),
    );
    // Sizes cross the MTU (16 KiB) so messages take several segments.
    let sizes = [1usize, 100, 4096, 16384, 40000, 200_000];
    for i in 0..sizes.len() {
        server
            .post_recv(RecvWr::new(i as u64, &[mr_a.sge(i * SLOT, SLOT)]))
            .unwrap();
    }
    for (i, &len) in sizes.iter().enumerate() {
        let data: Vec<u8> = (0..len).map(|j| (i * 31 + j * 7) as u8).collect();
        mr_b.write_at(4096, &data);
        client
            .post_send(SendWr::new(100 + i as u64, &[mr_b.sge(4096, len)]))
            .unwrap();
        let got = wait_n(&cq_b, 1, T);
        assert_eq!(
            (got[0].wr_id, got[0].status),
            (100 + i as u64, WcStatus::Success)
        );
        let got = wait_n(&cq_a, 1, T);
        assert_eq!(
            (
                got[0].wr_id,
                got[0].status,
                got[0].opcode,
                got[0].byte_len as usize
            ),
            (i as u64, WcStatus::Success, Opcode::Recv, len),
            "message {i}"
        );
        let mut back = vec![0u8; len];
        mr_a.read_at(i * SLOT, &mut back);
        assert!(back == data, "message {i} ({len} bytes) corrupted");
    }

    // And back: server to client.
    client
        .post_recv(RecvWr::new(7, &[mr_b.sge(0, 64)]))
        .unwrap();
    mr_a.write_at(4000, b"reply from the server");
    server
        .post_send(SendWr::new(8, &[mr_a.sge(4000, 21)]))
        .unwrap();
    let got = wait_n(&cq_b, 1, T);
    assert_eq!((got[0].wr_id, got[0].byte_len), (7, 21));
    let mut v = [0u8; 21];
    mr_b.read_at(0, &mut v);
    assert_eq!(&v, b"reply from the server");
    wait_n(&cq_a, 1, T);
}

/// Unreliable QPs on two nodes: the datagram lands in one receive WR with its source.
#[test]
fn udp_datagram_between_nodes_reports_its_source() {
    let fabric = test_fabric();
    let (a, b) = (nic(&fabric, "client"), nic(&fabric, "client2"));
    let (cq_a, cq_b) = (a.create_cq(16), b.create_cq(16));
    let qa = a
        .create_udp_qp(sock(&fabric, "client", 5000), QpAttr::new(&cq_a))
        .unwrap();
    let qb = b
        .create_udp_qp(sock(&fabric, "client2", 5001), QpAttr::new(&cq_b))
        .unwrap();
    let (mr_a, mr_b) = (
        a.alloc_region(4096, Access::READ_WRITE),
        b.alloc_region(4096, Access::READ_WRITE),
    );
    qb.post_recv(RecvWr::new(1, &[mr_b.sge(0, 1024)])).unwrap();
    mr_a.write_at(0, b"a datagram over myrinet");
    qa.post_send(SendWr::new(2, &[mr_a.sge(0, 23)]).to(qb.local_addr().unwrap()))
        .unwrap();
    let sent = wait_n(&cq_a, 1, T);
    assert_eq!((sent[0].wr_id, sent[0].status), (2, WcStatus::Success));
    let got = wait_n(&cq_b, 1, T);
    assert_eq!(
        (got[0].wr_id, got[0].status, got[0].byte_len, got[0].src),
        (
            1,
            WcStatus::Success,
            23,
            Some(sock(&fabric, "client", 5000))
        )
    );
    let mut v = [0u8; 23];
    mr_b.read_at(0, &mut v);
    assert_eq!(&v, b"a datagram over myrinet");
}

/// IPv4 is refused with a reason, and a node whose port is taken says which and what to do.
#[test]
fn ipv4_and_busy_ports_are_clear_errors() {
    let fabric = test_fabric();
    let a = nic(&fabric, "server");
    let err = a.listen("127.0.0.1:10809".parse().unwrap()).unwrap_err();
    let msg = format!(
        "{err}: {}",
        std::error::Error::source(&err)
            .map(|s| s.to_string())
            .unwrap_or_default()
    );
    assert!(msg.contains("IPv6 only"), "{msg}");
    let err = Nic::open(NicChoice::Lanai(fabric.config("server"))).unwrap_err();
    let port = fabric.params.node("server").unwrap().port.unwrap();
    assert!(
        err.to_string().contains(&format!(
            "fabric port {port} of node server is in use; pick another node with --lanai-node"
        )),
        "{err}"
    );
}

/// The firmware reaches only its fabric: Unix-domain sockets are refused, naming the path;
/// and it has no TLS.
#[test]
fn unix_sockets_and_tls_are_refused_clearly() {
    let fabric = test_fabric();
    let a = nic(&fabric, "server");
    let path = std::env::temp_dir().join("qpip-lanai-refuses.sock");
    let full = |err: &dyn std::error::Error| {
        format!(
            "{err}: {}",
            err.source().map(|s| s.to_string()).unwrap_or_default()
        )
    };
    let msg = full(&a.listen_unix(&path).unwrap_err());
    assert!(
        msg.contains("qpip-lanai-refuses.sock") && msg.contains("no Unix-domain sockets"),
        "{msg}"
    );
    assert!(!path.exists());
    let cq = a.create_cq(4);
    let qp = a.create_qp(QpAttr::new(&cq));
    let msg = full(&qp.connect_unix(&path, T).unwrap_err());
    assert!(msg.contains("no Unix-domain sockets"), "{msg}");
    // Nor does the firmware do TLS.
    let tls = qpip_core::TlsConfig {
        server: false,
        credentials: qpip_core::TlsCredentials::Psk {
            keys: vec![("alice".into(), vec![1; 32])],
        },
        server_name: None,
    };
    let msg = full(&qp.start_tls(tls, T).unwrap_err());
    assert!(msg.contains("does not do TLS"), "{msg}");
}

/// As root: the bridge creates its TUN device with the fabric's prefix, carries the kernel's
/// packets for a node to that node's port as Myrinet frames, hands frames for the bridge's
/// port to the kernel, and removes the device when it stops. No firmware involved: the node
/// is a plain socket here.
#[test]
fn bridge_carries_packets_between_kernel_and_fabric() {
    if !can_bridge() {
        return;
    }
    let fabric = test_fabric();
    let node = fabric.params.node("client").unwrap();
    let node_port = UdpSocket::bind(node.port.unwrap()).unwrap();
    node_port.set_read_timeout(Some(T)).unwrap();
    let mut bridge = Bridge::open(fabric.params.clone(), None).unwrap();
    assert_eq!(bridge.tun_name(), fabric.tun);
    let stop = Arc::new(AtomicBool::new(false));
    let runner = {
        let stop = stop.clone();
        std::thread::spawn(move || bridge.run(&stop))
    };

    // Kernel → fabric: a UDP datagram to the node's address arrives as a frame at its port.
    let kernel = UdpSocket::bind(SocketAddr::from((fabric.host_addr, 0))).unwrap();
    kernel
        .send_to(b"from the kernel", SocketAddr::from((node.addr, 9)))
        .unwrap();
    let mut buf = vec![0u8; 65536];
    let packet = loop {
        let n = node_port.recv(&mut buf).unwrap();
        let p = frame::decode(&buf[..n])
            .expect("a frame at its destination")
            .to_vec();
        if p.len() >= 48 && p[6] == 17 {
            break p; // skip anything else the kernel may send first
        }
    };
    assert_eq!(&packet[8..24], &fabric.host_addr.octets());
    assert_eq!(&packet[24..40], &node.addr.octets());
    assert_eq!(&packet[48..], b"from the kernel");

    // Fabric → kernel: the same packet with addresses and ports swapped (the UDP checksum
    // is symmetric in them) reaches the kernel's socket.
    let mut reply = packet.clone();
    reply[8..24].copy_from_slice(&node.addr.octets());
    reply[24..40].copy_from_slice(&fabric.host_addr.octets());
    let (sport, dport) = (reply[40..42].to_vec(), reply[42..44].to_vec());
    reply[40..42].copy_from_slice(&dport);
    reply[42..44].copy_from_slice(&sport);
    let bridge_port = fabric.params.bridge.as_ref().unwrap().port.unwrap();
    // A datagram into a TUN device that has just come up may be dropped by the kernel (seen
    // once under heavy load): send it again each second until it arrives, within T.
    kernel
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    let deadline = std::time::Instant::now() + T;
    let (n, from) = loop {
        node_port
            .send_to(&frame::encode(&[], &reply), bridge_port)
            .unwrap();
        match kernel.recv_from(&mut buf) {
            Ok(got) => break got,
            Err(e) if std::time::Instant::now() < deadline => {
                eprintln!("no datagram from the bridge yet ({e}); sending it again");
            }
            Err(e) => panic!("the bridge did not deliver the datagram within {T:?}: {e}"),
        }
    };
    assert_eq!(&buf[..n], b"from the kernel");
    assert_eq!(from, SocketAddr::from((node.addr, 9)));

    stop.store(true, Ordering::Relaxed);
    runner.join().unwrap().unwrap();
    let link = std::process::Command::new("ip")
        .args(["link", "show", &fabric.tun])
        .output()
        .unwrap();
    assert!(!link.status.success(), "{} still exists", fabric.tun);
}

/// A message split over two TCP segments, its receive WR posted before, between or after
/// them (a socket peer through the bridge sends this way; QP peers never do), while the host
/// sleeps on its CQ: the NIC must wake it. A send completes when the peer's firmware has
/// acknowledged it, so each segment is known to be in the server's NIC before the next step;
/// the exact orderings inside the NIC are the firmware tests' (virtual time).
#[test]
fn a_message_split_over_segments_completes_whenever_its_wr_is_posted() {
    use qpip_core::{LengthPrefixed, RawStream};
    let fabric = test_fabric();
    let (a, b) = (nic(&fabric, "server"), nic(&fabric, "client"));
    let (cq_a, cq_b) = (a.create_cq(64), b.create_cq(64));
    let listener = a.listen(sock(&fabric, "server", 7001)).unwrap();
    let server = a.create_qp(QpAttr::new(&cq_a).framer(LengthPrefixed::default()));
    let client = b.create_qp(QpAttr::new(&cq_b).framer(RawStream));
    client.connect_timeout(listener.local_addr(), T).unwrap();
    listener.accept_timeout(&server, T).unwrap();
    let (mr_a, mr_b) = (
        a.alloc_region(4096, Access::READ_WRITE),
        b.alloc_region(4096, Access::READ_WRITE),
    );
    let mut msg = 28u32.to_be_bytes().to_vec();
    msg.extend((0..28u8).map(|i| i + 1));
    mr_b.write_at(0, &msg);
    for (round, when) in ["before", "between", "after"].iter().enumerate() {
        let post = || {
            server
                .post_recv(RecvWr::new(round as u64, &[mr_a.sge(64 * round, 64)]))
                .unwrap()
        };
        let segment = |wr_id, off, len| {
            client
                .post_send(SendWr::new(wr_id, &[mr_b.sge(off, len)]))
                .unwrap();
            let sent = wait_n(&cq_b, 1, T);
            assert_eq!((sent[0].wr_id, sent[0].status), (wr_id, WcStatus::Success));
        };
        if *when == "before" {
            post();
        }
        segment(1, 0, 26);
        if *when == "between" {
            post();
        }
        // A host thread asleep on the CQ: no timeout, only the NIC's notify ends its wait.
        let (tx, woken) = std::sync::mpsc::channel();
        let waiter = {
            let cq_a = cq_a.clone();
            std::thread::spawn(move || {
                let mut c = [qpip_core::Completion::default(); 1];
                let n = cq_a.wait(&mut c, None).unwrap();
                let _ = tx.send((n, c[0]));
            })
        };
        let deadline = std::time::Instant::now() + T;
        while cq_a.sleepers() == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the waiter never slept"
            );
            std::thread::yield_now();
        }
        segment(2, 26, 6);
        if *when == "after" {
            // The whole message is in the NIC, and no WR for it: nothing may have completed.
            assert!(woken.try_recv().is_err(), "completed with no WR posted");
            post();
        }
        let (n, got) = woken
            .recv_timeout(T)
            .unwrap_or_else(|_| panic!("the host was never woken (WR posted {when} the segments)"));
        waiter.join().unwrap();
        assert_eq!(n, 1);
        assert_eq!(
            (got.wr_id, got.status, got.byte_len),
            (round as u64, WcStatus::Success, 28),
            "WR posted {when} the segments"
        );
        let mut placed = [0u8; 28];
        mr_a.read_at(64 * round, &mut placed);
        assert_eq!(&placed[..], &msg[4..], "WR posted {when} the segments");
    }
}

/// A doorbell FIFO of one entry: eight QPs posting at once hold each other back (the host's
/// PIO write waits for room) but nothing is lost and nothing deadlocks.
#[test]
fn a_tiny_doorbell_fifo_holds_hosts_back_without_losing_doorbells() {
    const QPS: usize = 8;
    const MSGS: usize = 50;
    let fabric = test_fabric();
    let mut cfg = fabric.config("client");
    cfg.params.device.doorbell_fifo_entries = 1;
    let b = Nic::open(NicChoice::Lanai(cfg)).unwrap();
    let a = nic(&fabric, "server");
    let (cq_a, cq_b) = (a.create_cq(QPS * MSGS), b.create_cq(QPS * MSGS));
    let listener = a.listen(sock(&fabric, "server", 7002)).unwrap();
    let mr_a = a.alloc_region(QPS * MSGS * 8, Access::READ_WRITE);
    let mut pairs = Vec::new();
    for _ in 0..QPS {
        let s = a.create_qp(QpAttr::new(&cq_a).depths(MSGS, MSGS));
        let c = b.create_qp(QpAttr::new(&cq_b).depths(MSGS, MSGS));
        c.connect_timeout(listener.local_addr(), T).unwrap();
        listener.accept_timeout(&s, T).unwrap();
        pairs.push((s, c));
    }
    for (q, (s, _)) in pairs.iter().enumerate() {
        for m in 0..MSGS {
            let off = (q * MSGS + m) * 8;
            s.post_recv(RecvWr::new(off as u64, &[mr_a.sge(off, 8)]))
                .unwrap();
        }
    }
    let senders: Vec<_> = pairs
        .into_iter()
        .enumerate()
        .map(|(q, (s, c))| {
            let mr = b.alloc_region(MSGS * 8, Access::READ);
            std::thread::spawn(move || {
                for m in 0..MSGS {
                    mr.write_at(m * 8, &((q * MSGS + m) as u64).to_be_bytes());
                    c.post_send(SendWr::new(m as u64, &[mr.sge(m * 8, 8)]))
                        .unwrap();
                }
                // The region must outlive the sends still in flight.
                (s, c, mr)
            })
        })
        .collect();
    let got = wait_n(&cq_a, QPS * MSGS, T);
    let bad: Vec<_> = got
        .iter()
        .filter(|c| c.status != WcStatus::Success)
        .collect();
    assert!(bad.is_empty(), "{} failed: {:?}", bad.len(), bad.first());
    for c in &got {
        let mut v = [0u8; 8];
        mr_a.read_at(c.wr_id as usize, &mut v);
        assert_eq!(
            u64::from_be_bytes(v) * 8,
            c.wr_id,
            "message landed in its slot"
        );
    }
    wait_n(&cq_b, QPS * MSGS, T);
    for s in senders {
        drop(s.join().unwrap());
    }
}

/// A NIC that goes away (its process ends) closes its connections on the wire: the peer's
/// posted receive completes with an error instead of waiting forever.
#[test]
fn a_peer_nic_shut_down_ends_the_connection() {
    let fabric = test_fabric();
    let (a, b) = (nic(&fabric, "server"), nic(&fabric, "client"));
    let (cq_a, cq_b) = (a.create_cq(16), b.create_cq(16));
    let listener = a.listen(sock(&fabric, "server", 7003)).unwrap();
    let server = a.create_qp(QpAttr::new(&cq_a));
    let client = b.create_qp(QpAttr::new(&cq_b));
    client.connect_timeout(listener.local_addr(), T).unwrap();
    listener.accept_timeout(&server, T).unwrap();
    let mr = a.alloc_region(64, Access::READ_WRITE);
    server.post_recv(RecvWr::new(1, &[mr.sge(0, 64)])).unwrap();
    drop((client, cq_b, b));
    let got = wait_n(&cq_a, 1, T);
    assert_eq!(got[0].wr_id, 1);
    assert_ne!(got[0].status, WcStatus::Success, "{:?}", got[0]);
}
