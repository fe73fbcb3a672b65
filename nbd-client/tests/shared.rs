//! Threads sharing one connection (`SharedClient`, through `Pool`): their requests are in
//! flight together, and a server restart loses none of them.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use nbd_client::{Client, ClientOptions, Pool};

const MIB: u64 = 1 << 20;

/// A server that answers a READ only once four READs are in progress at once (nbdkit's eval
/// plugin: each read marks its offset in a directory and waits up to 10 s for four marks),
/// and refuses it with EIO otherwise. Four threads on one connection each read once: every
/// read succeeds only if the connection carried them together.
#[test]
fn one_connection_carries_several_threads_requests_at_once() {
    if !have("nbdkit") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let marks = dir.path().join("marks");
    std::fs::create_dir(&marks).unwrap();
    let m = marks.display();
    let pread = format!(
        "touch {m}/$4; n=0; \
         while [ $(ls {m} | wc -l) -lt 4 ] && [ $n -lt 200 ]; do sleep 0.05; n=$((n+1)); done; \
         [ $(ls {m} | wc -l) -ge 4 ] || {{ echo 'EIO fewer than 4 reads at once' >&2; exit 1; }}; \
         head -c $3 /dev/zero"
    );
    let Some(server) = nbdkit(&[
        "eval",
        "get_size=echo 1M",
        // Without it the script's requests are served one at a time.
        "thread_model=echo parallel",
        &format!("pread={pread}"),
    ]) else {
        return;
    };
    let pool = Arc::new(Pool::connect(&server.uri, ClientOptions::default()).unwrap());
    assert!(
        !pool.caps().multi_conn,
        "the eval plugin does not allow multi-conn"
    );
    assert_eq!(pool.connections(), 1);
    let readers: Vec<_> = (0..4u64)
        .map(|i| {
            let pool = pool.clone();
            std::thread::spawn(move || pool.read(i * 4096, 4096))
        })
        .collect();
    for (i, r) in readers.into_iter().enumerate() {
        let data = r
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("read {i}: {e}"));
        assert_eq!(data, vec![0u8; 4096]);
    }
}

/// Four threads write their own regions through one connection, pipelined, flushing now and
/// then (FLUSH takes the connection alone), while the server is killed and started again on
/// the same port: every write comes back after the restart, acknowledged or reissued.
#[test]
fn threads_sharing_a_connection_lose_nothing_across_a_server_restart() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "r.img", 64 * MIB, &[]);
    let mut server = qpip_server("disk", &img, &[]);
    let port = server.port;
    let uri = server.uri.clone();
    let pool = Arc::new(Pool::connect(&uri, ClientOptions::default()).unwrap());
    assert_eq!(pool.connections(), 1);
    const THREADS: u64 = 4;
    const BLOCKS: u64 = 256;
    const BLOCK: u64 = 64 * 1024;
    let started = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (pool, started) = (pool.clone(), started.clone());
            std::thread::spawn(move || {
                for b in 0..BLOCKS {
                    let at = (t * BLOCKS + b) * BLOCK;
                    pool.write(at, &pattern(at, BLOCK as usize)).unwrap();
                    if b % 16 == 15 {
                        pool.flush().unwrap();
                    }
                    if b == 8 {
                        started.store(true, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !started.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the writers never started");
        std::thread::sleep(Duration::from_millis(1));
    }
    server.kill();
    std::thread::sleep(Duration::from_millis(300));
    let _server = qpip_server_on(port, "disk", &img, &[]);
    for w in writers {
        w.join().unwrap();
    }
    assert!(pool.reconnects() > 0, "the connection was never restored");
    pool.flush().unwrap();
    let mut check = Client::connect(&uri).unwrap();
    let mut back = vec![0u8; (THREADS * BLOCKS * BLOCK) as usize];
    check.read_at(0, &mut back).unwrap();
    for (i, block) in back.chunks(BLOCK as usize).enumerate() {
        let at = i as u64 * BLOCK;
        assert!(
            block == pattern(at, BLOCK as usize).as_slice(),
            "block at {at} differs"
        );
    }
}

/// Eight threads on one connection mix pipelined calls (writes, reads) with calls that take
/// the connection alone (WRITE_ZEROES, FLUSH): none hangs, and every thread reads back what
/// it wrote or zeroed, then a fresh connection does too.
#[test]
fn pipelined_and_exclusive_calls_mix_on_one_connection() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "m.img", 32 * MIB, &[]);
    let server = qpip_server("disk", &img, &[]);
    let pool = Arc::new(Pool::connect(&server.uri, ClientOptions::default()).unwrap());
    assert!(pool.caps().write_zeroes && pool.caps().flush);
    const THREADS: u64 = 8;
    const BLOCK: u64 = 16 * 1024;
    const BLOCKS: u64 = 128;
    let zeroed = |t: u64, b: u64| (t + b).is_multiple_of(5);
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                for b in 0..BLOCKS {
                    let at = (t * BLOCKS + b) * BLOCK;
                    pool.write(at, &pattern(at, BLOCK as usize)).unwrap();
                    if zeroed(t, b) {
                        pool.zero(at, BLOCK).unwrap();
                    }
                    if b % 8 == 7 {
                        pool.flush().unwrap();
                    }
                    let back = pool.read(at, BLOCK).unwrap();
                    let want = match zeroed(t, b) {
                        true => vec![0u8; BLOCK as usize],
                        false => pattern(at, BLOCK as usize),
                    };
                    assert!(back == want, "thread {t}: block at {at} differs");
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    let mut check = Client::connect(&server.uri).unwrap();
    let mut back = vec![0u8; (THREADS * BLOCKS * BLOCK) as usize];
    check.read_at(0, &mut back).unwrap();
    for (i, block) in back.chunks(BLOCK as usize).enumerate() {
        let (t, b) = (i as u64 / BLOCKS, i as u64 % BLOCKS);
        let at = i as u64 * BLOCK;
        match zeroed(t, b) {
            true => assert!(block.iter().all(|&x| x == 0), "block at {at} not zero"),
            false => assert!(
                block == pattern(at, BLOCK as usize).as_slice(),
                "block at {at} differs"
            ),
        }
    }
}
