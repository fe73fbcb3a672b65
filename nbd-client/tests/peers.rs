//! The client against real servers: ours, qemu-nbd, nbdkit and Debian's nbd-server.

mod common;

use common::*;
use nbd_client::{Client, ClientOptions};

const MIB: u64 = 1 << 20;

/// Pattern-verified read after write, across request splits, plus flush, zeroes and trim.
fn exercise(uri: &str, size: u64) -> Client {
    let mut c = Client::connect(uri).unwrap_or_else(|e| panic!("{uri}: {e}"));
    assert_eq!(c.size(), size, "{uri}");
    // 3 MiB + 4 KiB crosses many max_io splits.
    let off = MIB;
    let data = pattern(off, (3 * MIB + 4096) as usize);
    c.write_at(off, &data, false).unwrap();
    c.flush().unwrap();
    let mut back = vec![0u8; data.len()];
    c.read_at(off, &mut back).unwrap();
    assert!(back == data, "{uri}: read after write differs");
    // Into registered memory, the NIC places the data without a copy (simple replies and
    // OFFSET_DATA chunks alike, however the server splits them).
    let nic = c.nic().clone();
    let into = nic.alloc_region(data.len() + 3, qpip_core::Access::READ_WRITE);
    let placed = c.bytes_placed();
    c.read_at_mr(off, &into, 3, data.len()).unwrap();
    let mut got = vec![0u8; data.len()];
    into.read_at(3, &mut got);
    assert!(got == data, "{uri}: read into a region differs");
    assert_eq!(
        c.bytes_placed() - placed,
        data.len() as u64,
        "{uri}: bytes placed"
    );
    // FUA write of one block
    c.write_at(0, &pattern(0, 4096), true).unwrap();
    let mut b = vec![0u8; 4096];
    c.read_at(0, &mut b).unwrap();
    assert_eq!(b, pattern(0, 4096));
    if c.can_write_zeroes() {
        c.write_zeroes(off, 64 * 1024, false).unwrap();
        let mut z = vec![1u8; 64 * 1024];
        c.read_at(off, &mut z).unwrap();
        assert!(
            z.iter().all(|&x| x == 0),
            "{uri}: zeroes read back non-zero"
        );
    }
    if c.can_trim() {
        c.trim(2 * MIB, 64 * 1024).unwrap();
    }
    // Out of range and (for servers with a minimum block size) unaligned requests are refused
    // before they reach the wire.
    let mut one = [0u8; 4096];
    let e = c.read_at(size, &mut one).unwrap_err();
    assert!(matches!(e, nbd_client::Error::OutOfRange { .. }), "{e}");
    c
}

#[test]
fn qpip_server_read_write_flush_zeroes_block_status() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "a.img", 16 * MIB, &[(8 * MIB, MIB)]);
    let server = qpip_server("disk", &img, &[]);
    let mut c = exercise(&server.uri, 16 * MIB);
    assert!(c.structured_replies() && c.extended_headers());
    assert!(c.can_block_status());
    // Block status sees the data at 8 MiB and holes elsewhere (the pattern was written there).
    let ext = c.block_status(8 * MIB, MIB).unwrap();
    assert!(!ext.is_empty() && !ext[0].hole, "{ext:?}");
    let ext = c.block_status(12 * MIB, MIB).unwrap();
    assert!(ext[0].hole && ext[0].zero, "{ext:?}");
    c.disconnect().unwrap();
}

#[test]
fn qpip_server_pipelined_api() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "a.img", 8 * MIB, &[(0, 8 * MIB)]);
    let server = qpip_server("disk", &img, &[]);
    let mut c = Client::connect(&server.uri).unwrap();
    let n = 64u64;
    let io = u64::from(c.max_io()).min(64 * 1024);
    for i in 0..n {
        c.submit(
            i,
            nbd_client::Op::Read {
                offset: i * io,
                len: io as u32,
            },
        )
        .unwrap();
    }
    let mut seen = 0;
    while seen < n {
        let r = c.reap().unwrap();
        match r.result.unwrap() {
            nbd_client::Output::Data(d) => assert_eq!(d, pattern(r.tag * io, io as usize)),
            o => panic!("{o:?}"),
        }
        seen += 1;
    }
    c.disconnect().unwrap();
}

#[test]
fn qpip_server_simple_replies_fallback() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "a.img", 8 * MIB, &[]);
    let server = qpip_server("disk", &img, &[]);
    let opts = ClientOptions {
        structured_replies: false,
        ..Default::default()
    };
    let mut c = Client::connect_with(&server.uri, opts).unwrap();
    assert!(!c.structured_replies() && !c.can_block_status());
    let data = pattern(4096, 2 * MIB as usize);
    c.write_at(4096, &data, false).unwrap();
    let mut back = vec![0; data.len()];
    c.read_at(4096, &mut back).unwrap();
    assert!(back == data);
    c.disconnect().unwrap();
}

/// READ into and WRITE from registered memory, across request splits, with structured and
/// simple replies: the same bytes as the copying calls.
#[test]
fn qpip_server_registered_memory_reads_and_writes() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "a.img", 16 * MIB, &[]);
    let server = qpip_server("disk", &img, &[]);
    for structured in [true, false] {
        let nic = nbd_client::Nic::soft().unwrap();
        let opts = ClientOptions {
            structured_replies: structured,
            nic: Some(nic.clone()),
            ..Default::default()
        };
        let mut c = Client::connect_with(&server.uri, opts).unwrap();
        let len = (3 * MIB + 4096) as usize;
        let off = MIB + if structured { 0 } else { 8 * MIB };
        let mr = nic.alloc_region(len + 512, qpip_core::Access::READ_WRITE);
        let data = pattern(off, len);
        mr.write_at(100, &data);
        c.write_at_mr(off, &mr, 100, len, false).unwrap();
        let mut back = vec![0u8; len];
        c.read_at(off, &mut back).unwrap();
        assert!(back == data, "structured {structured}: write from a region");
        let into = nic.alloc_region(len + 7, qpip_core::Access::READ_WRITE);
        let placed = c.bytes_placed();
        c.read_at_mr(off, &into, 7, len).unwrap();
        assert_eq!(
            c.bytes_placed() - placed,
            len as u64,
            "structured {structured}"
        );
        let mut got = vec![0u8; len];
        into.read_at(7, &mut got);
        assert!(got == data, "structured {structured}: read into a region");
        // A hole reads as zeroes into the region too.
        c.read_at_mr(15 * MIB, &into, 0, 4096).unwrap();
        let mut z = vec![1u8; 4096];
        into.read_at(0, &mut z);
        assert!(z.iter().all(|&b| b == 0));
        // Ranges outside the region are refused before anything is sent.
        assert!(c.read_at_mr(0, &into, len, 4096).is_err());
        assert!(c.write_at_mr(0, &mr, len, 4096, false).is_err());
        c.disconnect().unwrap();
    }
}

/// A graceful restart: SIGTERM makes our server refuse new requests with ESHUTDOWN before it
/// closes. The client does not hand ESHUTDOWN to the caller: it reconnects to the restarted
/// server and the request goes again there.
#[test]
fn requests_refused_with_eshutdown_go_again_after_a_graceful_restart() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "g.img", 16 * MIB, &[]);
    let mut server = qpip_server("disk", &img, &[]);
    let port = server.port;
    let mut c = Client::connect(&server.uri).unwrap();
    let data = pattern(MIB, 64 * 1024);
    c.write_at(MIB, &data, false).unwrap();
    c.flush().unwrap();
    // SAFETY: plain kill(2) of our own child.
    unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
    let img2 = img.clone();
    let restarter = std::thread::spawn(move || {
        server.child.wait().unwrap();
        qpip_server_on(port, "disk", &img2, &[])
    });
    // Reads while the server drains (it answers ESHUTDOWN), closes and comes back: every
    // one succeeds, until the client is on the new server.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut back = vec![0u8; data.len()];
    while c.reconnects() == 0 {
        assert!(std::time::Instant::now() < deadline, "never reconnected");
        c.read_at(MIB, &mut back).unwrap();
        assert!(back == data, "data differs across the restart");
    }
    let _server = restarter.join().unwrap();
    c.write_at(2 * MIB, &data, false).unwrap();
    c.disconnect().unwrap();
}

/// A server gone for good: once the reconnect timeout has passed, the error says why the
/// last attempt failed (here the connection refused), not only "cannot connect to URI".
#[test]
fn giving_up_on_a_vanished_server_says_why_the_last_attempt_failed() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "v.img", 4 * MIB, &[]);
    let server = qpip_server("disk", &img, &[]);
    let opts = ClientOptions {
        reconnect_timeout: std::time::Duration::from_secs(2),
        ..ClientOptions::default()
    };
    let mut c = Client::connect_with(&server.uri, opts).unwrap();
    drop(server);
    let mut buf = vec![0u8; 4096];
    let e = c.read_at(0, &mut buf).unwrap_err();
    assert!(matches!(e, nbd_client::Error::ConnectionLost { .. }), "{e}");
    assert!(e.to_string().contains("Connection refused"), "{e}");
}

#[test]
fn list_and_info() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "a.img", 4 * MIB, &[]);
    let server = qpip_server("disk", &img, &[]);
    let info = Client::info(&server.uri).unwrap();
    assert_eq!(info.size, 4 * MIB);
    let list = Client::list(&server.uri).unwrap();
    assert!(list.iter().any(|e| e.name == "disk"), "{list:?}");
    let bad = Client::connect(&format!("nbd://127.0.0.1:{}/nope", server.port)).unwrap_err();
    assert!(bad.to_string().contains("nope"), "{bad}");
}

#[test]
fn qemu_nbd_peer() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "q.img", 16 * MIB, &[(8 * MIB, MIB)]);
    let Some(peer) = qemu_nbd("q", &img) else {
        return;
    };
    let mut c = exercise(&peer.uri, 16 * MIB);
    // qemu-nbd (8.2 and later) offers extended headers
    assert!(c.structured_replies() && c.extended_headers() && c.can_block_status());
    let ext = c.block_status(12 * MIB, 4 * MIB).unwrap();
    assert!(ext[0].zero, "{ext:?}");
    let ext = c.block_status(8 * MIB, MIB).unwrap();
    assert!(!ext[0].hole, "{ext:?}");
    c.disconnect().unwrap();
}

#[test]
fn qemu_nbd_peer_compact_headers() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "q.img", 16 * MIB, &[(8 * MIB, MIB)]);
    let Some(peer) = qemu_nbd("q", &img) else {
        return;
    };
    let opts = ClientOptions {
        extended_headers: false,
        ..Default::default()
    };
    let mut c = Client::connect_with(&peer.uri, opts).unwrap();
    assert!(c.structured_replies() && !c.extended_headers());
    let ext = c.block_status(8 * MIB, MIB).unwrap();
    assert!(!ext[0].hole, "{ext:?}");
    c.disconnect().unwrap();
}

#[test]
fn nbdkit_memory_peer() {
    let Some(peer) = nbdkit(&["memory", "64M"]) else {
        return;
    };
    let mut c = exercise(&peer.uri, 64 * MIB);
    assert!(c.can_block_status());
    let ext = c.block_status(32 * MIB, MIB).unwrap();
    assert!(ext[0].zero, "{ext:?}");
    c.disconnect().unwrap();
}

#[test]
fn nbdkit_file_peer() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "k.img", 16 * MIB, &[]);
    let file = format!("file={}", img.display());
    let Some(peer) = nbdkit(&["file", &file]) else {
        return;
    };
    exercise(&peer.uri, 16 * MIB).disconnect().unwrap();
}

#[test]
fn debian_nbd_server_simple_replies() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "d.img", 16 * MIB, &[]);
    let Some(peer) = debian_nbd_server("d", &img) else {
        return;
    };
    let c = exercise(&peer.uri, 16 * MIB);
    assert!(
        !c.structured_replies(),
        "nbd-server offers simple replies only"
    );
    assert!(!c.can_block_status());
    c.disconnect().unwrap();
}

/// A server that stops answering (nbdkit's delay filter holds reads for a minute): the
/// request times out, is reissued on a new connection, and fails with EIO once the server
/// has been silent for the reconnect limit as well. Writes on the same server still work.
#[test]
fn hung_server_times_out_with_eio() {
    let Some(peer) = nbdkit(&["--filter=delay", "memory", "16M", "rdelay=60"]) else {
        return;
    };
    let opts = ClientOptions {
        request_timeout: Some(std::time::Duration::from_secs(1)),
        reconnect_timeout: std::time::Duration::from_secs(2),
        ..ClientOptions::default()
    };
    let mut c = Client::connect_with(&peer.uri, opts.clone()).unwrap();
    c.write_at(0, &pattern(0, 4096), true).unwrap();
    let start = std::time::Instant::now();
    let mut buf = vec![0u8; 4096];
    let e = c.read_at(0, &mut buf).unwrap_err();
    assert!(matches!(e, nbd_client::Error::ConnectionLost { .. }), "{e}");
    assert!(c.reconnects() >= 1, "the stalled read was not reissued");
    // Well before the server's minute: the timeout, not the reply, ended the wait.
    assert!(start.elapsed() < std::time::Duration::from_secs(30));
    assert!(buf.iter().all(|&b| b == 0), "no data may be reported");
}

/// Unix-domain sockets, with each server that has them: nbdkit -U, qemu-nbd -k, and ours.
#[test]
fn unix_socket_peers() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "u.img", 16 * MIB, &[]);
    let file = format!("file={}", img.display());
    let qimg = image(dir.path(), "q.img", 16 * MIB, &[]);
    let ours = image(dir.path(), "o.img", 16 * MIB, &[]);
    let peers = [
        unix_peer(
            "nbdkit",
            "-U",
            &["-f", "--exit-with-parent", "file", &file],
            "",
        ),
        unix_peer(
            "qemu-nbd",
            "-k",
            &[
                "-f",
                "raw",
                "-x",
                "q",
                "--persistent",
                qimg.to_str().unwrap(),
            ],
            "q",
        ),
        unix_peer(
            qpip_server_bin().to_str().unwrap(),
            "--socket",
            &["--export", &format!("o={}", ours.display())],
            "o",
        ),
    ];
    for peer in peers.into_iter().flatten() {
        assert!(peer.uri.starts_with("nbd+unix:///"), "{}", peer.uri);
        exercise(&peer.uri, 16 * MIB).disconnect().unwrap();
    }
}

/// nbds:// with each TLS server and both kinds of credentials: nbdkit --tls=require, qemu-nbd
/// --tls-creds, and ours.
#[test]
fn tls_peers_x509_and_psk() {
    let Some(creds) = tls_certs() else { return };
    let d = creds.path().to_str().unwrap().to_string();
    let psk = format!("{d}/keys.psk");
    let dir = tempfile::tempdir().unwrap();
    let img = |n: &str| image(dir.path(), n, 16 * MIB, &[]);
    let (q1, q2, o1, o2) = (img("q1"), img("q2"), img("o1"), img("o2"));
    let x509_q = format!("tls-creds-x509,id=t,dir={d},endpoint=server");
    let psk_q = format!("tls-creds-psk,id=t,dir={d},endpoint=server");
    let q = |i: &std::path::Path, obj: &str, query: &str| {
        let (path, tail) = (i.to_str().unwrap().to_string(), query.to_string());
        let args = [
            "-b",
            "127.0.0.1",
            "-f",
            "raw",
            "-x",
            "q",
            "--persistent",
            "--shared=8",
        ];
        let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        all.extend([
            "--object".into(),
            obj.into(),
            "--tls-creds".into(),
            "t".into(),
            path,
        ]);
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        tcp_peer("qemu-nbd", "-p", &all, &format!("nbds://{tail}"))
    };
    let qpip = qpip_server_bin().to_str().unwrap().to_string();
    let ours = |i: &std::path::Path, flag: &str, cred: &str, uri: &str| {
        let e = format!("o={}", i.display());
        tcp_peer(
            &qpip,
            "--port",
            &["--bind", "127.0.0.1", flag, cred, "--export", &e],
            uri,
        )
    };
    let peers = [
        tcp_peer(
            "nbdkit",
            "-p",
            &[
                "-f",
                "-i",
                "127.0.0.1",
                "--exit-with-parent",
                "--tls=require",
                &format!("--tls-certificates={d}"),
                "memory",
                "16M",
            ],
            &format!("nbds://localhost:PORT/?tls-certificates={d}"),
        ),
        tcp_peer(
            "nbdkit",
            "-p",
            &[
                "-f",
                "-i",
                "127.0.0.1",
                "--exit-with-parent",
                "--tls=require",
                &format!("--tls-psk={psk}"),
                "memory",
                "16M",
            ],
            &format!("nbds://alice@127.0.0.1:PORT/?tls-psk-file={psk}"),
        ),
        q(
            &q1,
            &x509_q,
            &format!("localhost:PORT/q?tls-certificates={d}"),
        ),
        q(
            &q2,
            &psk_q,
            &format!("alice@127.0.0.1:PORT/q?tls-psk-file={psk}"),
        ),
        ours(
            &o1,
            "--tls-certs",
            &d,
            &format!("nbds://localhost:PORT/o?tls-certificates={d}"),
        ),
        ours(
            &o2,
            "--tls-psk",
            &psk,
            &format!("nbds://alice@127.0.0.1:PORT/o?tls-psk-file={psk}"),
        ),
    ];
    for peer in peers.into_iter().flatten() {
        let c = exercise(&peer.uri, 16 * MIB);
        assert!(c.structured_replies(), "{}", peer.uri);
        c.disconnect().unwrap();
    }
}

/// An error with its causes, as the command-line tools print it.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s += &format!(": {c}");
        cur = c.source();
    }
    s
}

/// A TLS client never falls back to plaintext, and refuses a server it cannot trust.
#[test]
fn tls_refusals_are_clear() {
    let Some(creds) = tls_certs() else { return };
    let d = creds.path();
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "p.img", MIB, &[]);
    let plain = qpip_server("p", &img, &[]);
    let uri = format!(
        "nbds://127.0.0.1:{}/p?tls-certificates={}",
        plain.port,
        d.display()
    );
    let e = chain(&Client::connect(&uri).unwrap_err());
    assert!(e.contains("refused TLS"), "{e}");
    let kit = |cred: String, uri: &str| {
        let args = [
            "-f",
            "-i",
            "127.0.0.1",
            "--exit-with-parent",
            "--tls=require",
        ];
        let mut all: Vec<&str> = args.to_vec();
        all.extend([cred.as_str(), "memory", "1M"]);
        tcp_peer("nbdkit", "-p", &all, uri)
    };
    let (Some(x509), Some(psk)) = (
        kit(
            format!("--tls-certificates={}", d.display()),
            "nbds://localhost:PORT/",
        ),
        kit(
            format!("--tls-psk={}", d.join("keys.psk").display()),
            "nbds://alice@127.0.0.1:PORT/",
        ),
    ) else {
        return;
    };
    let wrong_ca = format!(
        "{}?tls-certificates={}",
        x509.uri,
        d.join("other-ca").display()
    );
    let e = chain(&Client::connect(&wrong_ca).unwrap_err());
    assert!(e.contains("certificate verify failed"), "{e}");
    let wrong = dir.path().join("wrong.psk");
    std::fs::write(&wrong, format!("alice:{}\n", "cd".repeat(32))).unwrap();
    let wrong_psk = format!("{}?tls-psk-file={}", psk.uri, wrong.display());
    let e = chain(&Client::connect(&wrong_psk).unwrap_err());
    assert!(e.contains("TLS handshake failed"), "{e}");
    let nbdkit = x509;
    // Plaintext to a server that requires TLS: its refusal, named.
    let plain_uri = nbdkit.uri.replace("nbds://", "nbd://");
    let e = chain(&Client::connect(&plain_uri).unwrap_err());
    assert!(e.contains("TLS"), "{e}");
}

/// One BLOCK_STATUS asking for base:allocation and qemu:allocation-depth at once: a chunk
/// for each context in the one reply, compact and extended (64-bit) alike, the same extents
/// from qpip-nbd-server -A as from qemu-nbd -A (issue 35).
#[test]
fn both_contexts_in_one_block_status_reply() {
    if !qpip_test_support::ci::require(&["qemu-nbd", "qemu-img", "qemu-io"]) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = std::process::Command::new("sh")
        .current_dir(d)
        .args([
            "-c",
            "qemu-img create -q -f qcow2 a.qcow2 4M \
             && qemu-io -f qcow2 -c 'write -P 1 1M 64k' -c 'write -z 2M 64k' a.qcow2 >/dev/null",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let img = d.join("a.qcow2");
    let ours = qpip_server("x", &img, &["-r", "-A"]);
    let path = img.display().to_string();
    let Some(theirs) = tcp_peer(
        "qemu-nbd",
        "-p",
        &[
            "-r",
            "-t",
            "-A",
            "-f",
            "qcow2",
            "-x",
            "x",
            "-b",
            "127.0.0.1",
            &path,
        ],
        "nbd://127.0.0.1:PORT/x",
    ) else {
        return;
    };
    const DEPTH: &str = "qemu:allocation-depth";
    // Each context's runs (offset, length, flags), merged, from one reply.
    let runs = |uri: &str, extended: bool| {
        let opts = ClientOptions {
            meta_contexts: vec![DEPTH.to_owned()],
            extended_headers: extended,
            ..Default::default()
        };
        let mut c = Client::connect_with(uri, opts).unwrap();
        assert_eq!(c.extended_headers(), extended, "{uri}");
        let names: Vec<&str> = c.contexts().iter().map(|(_, n)| n.as_str()).collect();
        assert_eq!(names, ["base:allocation", DEPTH], "{uri}");
        let contexts = c.contexts().to_vec();
        c.submit(
            1,
            nbd_client::Op::BlockStatus {
                offset: 0,
                len: 4 << 20,
            },
        )
        .unwrap();
        let nbd_client::Output::Extents(all) = c.reap().unwrap().result.unwrap() else {
            panic!("not extents");
        };
        c.disconnect().unwrap();
        contexts
            .iter()
            .map(|(id, name)| {
                let mut v: Vec<(u64, u64, u32)> = Vec::new();
                for e in all.iter().filter(|e| e.context_id == *id) {
                    match v.last_mut() {
                        Some((o, l, f)) if *f == e.flags && *o + *l == e.offset => *l += e.length,
                        _ => v.push((e.offset, e.length, e.flags)),
                    }
                }
                (name.clone(), v)
            })
            .collect::<Vec<_>>()
    };
    const K64: u64 = 64 << 10;
    let depth = vec![
        (0, MIB, 0),
        (MIB, K64, 1),
        (MIB + K64, MIB - K64, 0),
        (2 * MIB, K64, 1),
        (2 * MIB + K64, 2 * MIB - K64, 0),
    ];
    for extended in [true, false] {
        let (o, q) = (runs(&ours.uri, extended), runs(&theirs.uri, extended));
        assert_eq!(o, q, "extended headers: {extended}");
        assert_eq!(o[1], (DEPTH.to_owned(), depth.clone()));
        assert!(
            o[0].1.iter().any(|r| r.2 == 0),
            "base:allocation: {:?}",
            o[0]
        );
    }
}
