//! Dropping a NIC gives back everything it took: a NIC goes away when its last handle (`Nic`
//! clone, QP or listener) is dropped, and then its threads have ended and every descriptor it
//! opened is closed; WRs still outstanding complete, flushed, into CQs that outlive it.
//!
//! One test in its own binary: it counts the whole process's descriptors and threads, which
//! another test running beside it would change.

mod common;
mod lanai_common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use lanai_common::test_fabric;
use qpip_core::{
    Access, Completion, CompletionQueue, Nic, NicChoice, QpAttr, RecvWr, SendWr, SoftConfig,
    WcStatus,
};

const T: Duration = Duration::from_secs(30);
const CYCLES: usize = 200;

/// Open descriptors of this process.
fn descriptors() -> usize {
    // The directory's own descriptor is counted too, the same each time.
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// Threads of this process, by name.
fn threads() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .map(|t| {
            let comm = t.unwrap().path().join("comm");
            std::fs::read_to_string(comm)
                .unwrap_or_default()
                .trim()
                .to_string()
        })
        .collect()
}

/// A server NIC, a client NIC (the same one for the soft NIC) and where the server listens.
type Open<'a> = &'a dyn Fn() -> (Nic, Nic, SocketAddr);

/// One NIC's life: a listener, a connected reliable QP pair with one message exchanged, a
/// second listener left open, a receive WR outstanding on each QP; then every handle is
/// dropped, the CQs kept: each outstanding WR must have completed there with an error.
fn cycle(what: &str, open: Open<'_>) {
    let (server, client, server_at) = open();
    let (server_cq, client_cq) = (server.create_cq(16), client.create_cq(16));
    let listener = server.listen(server_at).unwrap();
    let idle_listener = server.listen(server_at).unwrap();
    let s = server.create_qp(QpAttr::new(&server_cq));
    let c = client.create_qp(QpAttr::new(&client_cq));
    c.connect_timeout(listener.local_addr(), T).unwrap();
    listener.accept_timeout(&s, T).unwrap();
    let (smr, cmr) = (
        server.alloc_region(64, Access::READ_WRITE),
        client.alloc_region(64, Access::READ_WRITE),
    );
    s.post_recv(RecvWr::new(1, &[smr.sge(0, 64)])).unwrap();
    cmr.write_at(0, b"ping");
    c.post_send(SendWr::new(2, &[cmr.sge(0, 4)])).unwrap();
    let got = wait_n(&server_cq, 1, T);
    assert_eq!((got[0].wr_id, got[0].status), (1, WcStatus::Success));
    let sent = wait_n(&client_cq, 1, T);
    assert_eq!((sent[0].wr_id, sent[0].status), (2, WcStatus::Success));
    // Outstanding when the NIC goes.
    s.post_recv(RecvWr::new(3, &[smr.sge(0, 64)])).unwrap();
    c.post_recv(RecvWr::new(4, &[cmr.sge(0, 64)])).unwrap();
    // The Nic handles first: the QPs and listeners keep the NIC until they go too.
    drop((server, client));
    drop((s, c, listener));
    drop(idle_listener);
    for (cq, wr_id) in [(&server_cq, 3), (&client_cq, 4)] {
        let c = only_completion(what, cq);
        assert_eq!(c.wr_id, wr_id, "{what}: {c:?}");
        assert_ne!(c.status, WcStatus::Success, "{what}: {c:?}");
    }
}

/// The one completion a CQ holds once its NIC is gone (a wait with a deadline: nothing is
/// left to drive it).
fn only_completion(what: &str, cq: &CompletionQueue) -> Completion {
    let mut out = [Completion::default(); 4];
    let n = cq.wait(&mut out, Some(T)).unwrap();
    assert_eq!(
        n,
        1,
        "{what}: WRs outstanding at the NIC's end: {:?}",
        &out[..n]
    );
    out[0]
}

/// Opens and drops a NIC `CYCLES` times: the process's descriptors and threads are back
/// where they were before the first each time (no slack: nothing a NIC sets up outlives it).
fn opens_and_drops(what: &str, open: Open<'_>) {
    let (fds, tasks) = (descriptors(), threads());
    for i in 0..CYCLES {
        cycle(what, open);
        assert!(
            descriptors() <= fds,
            "{what}: {} descriptors after {} NICs, {fds} before",
            descriptors(),
            i + 1
        );
        // The kernel lists an exited thread until it has reaped it, which may come after its
        // join returned (the owner of an io_uring, say): give it a moment, not a leak.
        let deadline = Instant::now() + Duration::from_secs(10);
        while threads().len() > tasks.len() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let now = threads();
        assert!(
            now.len() <= tasks.len(),
            "{what}: threads {now:?} after {} NICs, {tasks:?} before",
            i + 1
        );
    }
}

fn soft(queues: usize, run_to_completion: bool) -> (Nic, Nic, SocketAddr) {
    let nic = Nic::open(NicChoice::Soft(SoftConfig {
        queues,
        run_to_completion,
        ..SoftConfig::default()
    }))
    .unwrap();
    (nic.clone(), nic, addr(V6))
}

#[test]
fn dropping_a_nic_ends_its_threads_closes_its_descriptors_and_flushes_its_wrs() {
    for (queues, rtc) in [(1, true), (3, true), (1, false), (3, false)] {
        let what = format!("soft NIC, {queues} queue(s), run to completion {rtc}");
        opens_and_drops(&what, &|| soft(queues, rtc));
    }
    let fabric = test_fabric();
    let lanai = || {
        let open = |node: &str| Nic::open(NicChoice::Lanai(fabric.config(node))).unwrap();
        let at = SocketAddr::from((fabric.addr("server"), 0));
        (open("server"), open("client"), at)
    };
    opens_and_drops("lanai NIC", &lanai);
}
