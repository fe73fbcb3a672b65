//! TLS done by the soft NIC: two QPs switch a connection to TLS with `start_tls` and keep
//! exchanging plaintext messages, the engine running the handshake and the record layer.
//! Credentials are made at test time (scripts/tls-test-certs).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{V4, pair, wait_n};
use qpip_core::{
    Access, CompletionQueue, Nic, QpState, QueuePair, RecvWr, SendWr, TlsConfig, TlsCredentials,
    WcStatus,
};

const T: Duration = Duration::from_secs(10);

fn certs() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/tls-test-certs");
    let st = std::process::Command::new(script)
        .arg(dir.path())
        .status()
        .expect("running scripts/tls-test-certs (needs certtool and psktool: scripts/setup)");
    assert!(st.success());
    dir
}

fn x509(dir: &Path, server: bool, ca: PathBuf) -> TlsConfig {
    let side = if server { "server" } else { "client" };
    TlsConfig {
        server,
        credentials: TlsCredentials::X509 {
            ca: Some(ca),
            cert: Some(dir.join(format!("{side}-cert.pem"))),
            key: Some(dir.join(format!("{side}-key.pem"))),
            verify_peer: true,
        },
        server_name: (!server).then(|| "localhost".into()),
    }
}

fn psk(server: bool, key: Vec<u8>) -> TlsConfig {
    TlsConfig {
        server,
        credentials: TlsCredentials::Psk {
            keys: vec![("alice".into(), key)],
        },
        server_name: None,
    }
}

/// Both ends start TLS at once; the two results (client, server).
fn handshake(
    client: &QueuePair,
    server: &QueuePair,
    c: TlsConfig,
    s: TlsConfig,
) -> (qpip_core::Result<()>, qpip_core::Result<()>) {
    std::thread::scope(|scope| {
        let srv = scope.spawn(|| server.start_tls(s, T));
        let cli = client.start_tls(c, T);
        (cli, srv.join().unwrap())
    })
}

/// Messages both ways, one larger than a TLS record, arrive intact.
fn exchange(nic: &Nic, cq: &CompletionQueue, client: &QueuePair, server: &QueuePair) {
    let mr = nic.alloc_region(1 << 20, Access::READ_WRITE);
    let big: Vec<u8> = (0..100_000u32).map(|i| (i * 13) as u8).collect();
    server
        .post_recv(RecvWr::new(1, &[mr.sge(0, 1 << 18)]))
        .unwrap();
    client
        .post_recv(RecvWr::new(2, &[mr.sge(1 << 18, 1 << 18)]))
        .unwrap();
    mr.write_at(1 << 19, &big);
    client
        .post_send(SendWr::new(3, &[mr.sge(1 << 19, big.len())]))
        .unwrap();
    server
        .post_send(SendWr::new(4, &[mr.sge(1 << 19, 10)]))
        .unwrap();
    let got = wait_n(cq, 4, T);
    for c in &got {
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
    }
    let len = |id| got.iter().find(|c| c.wr_id == id).unwrap().byte_len as usize;
    assert_eq!((len(1), len(2)), (big.len(), 10));
    let mut back = vec![0u8; big.len()];
    mr.read_at(0, &mut back);
    assert!(back == big, "the message came out different");
}

#[test]
fn x509_and_psk_connections_carry_messages() {
    let dir = certs();
    let d = dir.path();
    let keys = qpip_core::tls::read_psk_file(&d.join("keys.psk"), Some("alice")).unwrap();
    let nic = Nic::soft().unwrap();
    for (c, s) in [
        (
            x509(d, false, d.join("ca-cert.pem")),
            x509(d, true, d.join("ca-cert.pem")),
        ),
        (psk(false, keys[0].1.clone()), psk(true, keys[0].1.clone())),
    ] {
        let cq = nic.create_cq(64);
        let (client, server) = pair(&nic, &cq, V4);
        let (a, b) = handshake(&client, &server, c, s);
        a.unwrap();
        b.unwrap();
        exchange(&nic, &cq, &client, &server);
    }
}

#[test]
fn wrong_ca_and_wrong_psk_fail_both_ends() {
    let dir = certs();
    let d = dir.path();
    let nic = Nic::soft().unwrap();
    let cases = [
        (
            x509(d, false, d.join("other-ca/ca-cert.pem")),
            x509(d, true, d.join("ca-cert.pem")),
            "certificate verify failed",
        ),
        (psk(false, vec![1; 32]), psk(true, vec![2; 32]), ""),
    ];
    for (c, s, why) in cases {
        let cq = nic.create_cq(64);
        let (client, server) = pair(&nic, &cq, V4);
        let (a, b) = handshake(&client, &server, c, s);
        let e = a.expect_err("the client must not accept the server");
        assert!(e.to_string().contains(why), "{e}");
        assert!(b.is_err(), "the server must fail too");
        assert_eq!(client.state(), QpState::Error);
    }
}

#[test]
fn garbage_instead_of_a_handshake_fails_cleanly() {
    let dir = certs();
    let d = dir.path();
    let nic = Nic::soft().unwrap();
    let cq = nic.create_cq(16);
    let listener = nic.listen(V4.parse().unwrap()).unwrap();
    let server = nic.create_qp(qpip_core::QpAttr::new(&cq));
    let mut peer = std::net::TcpStream::connect(listener.local_addr()).unwrap();
    listener.accept_timeout(&server, T).unwrap();
    use std::io::Write;
    peer.write_all(b"GET / HTTP/1.0\r\n\r\nthis is not TLS at all")
        .unwrap();
    let e = server
        .start_tls(x509(d, true, d.join("ca-cert.pem")), T)
        .unwrap_err();
    assert!(matches!(e, qpip_core::Error::Tls(_)), "{e}");
    assert_eq!(server.state(), QpState::Error);
    // Credentials that do not load are a clear error before any connection.
    let mut bad = x509(d, true, d.join("ca-cert.pem"));
    if let TlsCredentials::X509 { key, .. } = &mut bad.credentials {
        *key = Some(d.join("client-key.pem"));
    }
    let e = qpip_core::check_tls(&bad).unwrap_err().to_string();
    assert!(e.contains("client-key.pem"), "{e}");
}
