//! Deterministic property test: ~100k random and mutated inputs.

use super::*;

struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(rng: &mut XorShift, seed: &[u8]) -> Vec<u8> {
    let mut v = seed.to_vec();
    for _ in 0..=rng.below(4) {
        match rng.below(6) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] = rng.next() as u8;
            }
            2 if !v.is_empty() => {
                let i = rng.below(v.len());
                v.truncate(i);
            }
            3 => {
                let i = rng.below(v.len() + 1);
                v.insert(i, rng.next() as u8);
            }
            4 if v.len() >= 4 => {
                // smash a 32-bit field (often a length)
                let i = rng.below(v.len() - 3);
                let val = [0u32, 1, 0xffff_ffff, 0x8000_0000, 4097, 65537][rng.below(6)];
                v[i..i + 4].copy_from_slice(&val.to_be_bytes());
            }
            _ => {}
        }
    }
    v
}

#[test]
fn hundred_thousand_inputs_do_not_panic() {
    let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
    let seeds = seeds();
    let harness = |target: &str| -> fn(&[u8]) {
        match target {
            "server_handshake" => server_handshake,
            "client_handshake" => client_handshake,
            "transmission" => transmission,
            "framers" => framers,
            "replies" => replies,
            other => panic!("no harness for {other}"),
        }
    };
    let iterations = 20_000;
    for _ in 0..iterations {
        for (target, inputs) in &seeds {
            let input = if rng.below(4) == 0 {
                let n = rng.below(200);
                (0..n).map(|_| rng.next() as u8).collect()
            } else {
                let pick = rng.below(inputs.len());
                mutate(&mut rng, &inputs[pick].1)
            };
            harness(target)(&input);
        }
    }
}

/// The files under fuzz/seeds/ are exactly what [`seeds`] builds.
/// `QPIP_WRITE_SEEDS=1 cargo test -p nbd-proto committed_seeds` rewrites them.
#[test]
fn committed_seeds_are_current() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds");
    let write = std::env::var_os("QPIP_WRITE_SEEDS").is_some();
    for (target, inputs) in seeds() {
        let dir = root.join(target);
        if write {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            for (name, bytes) in &inputs {
                std::fs::write(dir.join(name), bytes).unwrap();
            }
        }
        let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        on_disk.sort();
        let mut names: Vec<String> = inputs.iter().map(|(n, _)| n.clone()).collect();
        names.sort();
        assert_eq!(on_disk, names, "{}: stale seed files", dir.display());
        for (name, bytes) in &inputs {
            let path = dir.join(name);
            assert_eq!(
                &std::fs::read(&path).unwrap(),
                bytes,
                "{} is stale",
                path.display()
            );
        }
    }
}

/// The handshake seeds reach the end of a real negotiation, and the benign reply seeds
/// complete their request through the client's checks (they are meaningful starting
/// points, not noise).
#[test]
fn seeds_are_meaningful() {
    let seeds = seeds();
    let get = |t: &str| &seeds.iter().find(|(n, _)| *n == t).unwrap().1;
    // In the harnesses' format the chunks reassemble the recorded conversation, and
    // the client, fed them, reaches the end of its goal.
    for (name, input) in get("client_handshake") {
        let mut cl = client_for(input[0]);
        let mut last = Ok(ClientEvent::Continue);
        for piece in chunks(&input[1..]) {
            last = cl.feed(piece, &mut Vec::new());
            if !matches!(last, Ok(ClientEvent::Continue)) {
                break;
            }
        }
        let ok = matches!(
            last,
            Ok(ClientEvent::Connected(_) | ClientEvent::Listed(_) | ClientEvent::Info(_))
        );
        // refused, as they should be: NBD_OPT_EXPORT_NAME cannot negotiate the block
        // size this server requires, and a server without NBD_OPT_GO has no INFO either
        let refused = ["connect-export-name.block-size", "info.no-go"];
        assert_eq!(ok, !refused.contains(&name.as_str()), "{name}: {last:?}");
    }
    for (name, input) in get("server_handshake") {
        // A server that requires block-size negotiation refuses NBD_OPT_EXPORT_NAME,
        // which cannot negotiate it (as the spec says); every other connect succeeds.
        if name.starts_with("connect") && name != "connect-export-name.block-size" {
            let mut s = ServerHandshake::new(server_config(input[0]));
            let stream: Vec<u8> = chunks(&input[1..]).flatten().copied().collect();
            let r = s.feed(&stream, &mut Vec::new());
            assert!(matches!(r, Ok(ServerEvent::Done(_))), "{name}: {r:?}");
        }
    }
    // The request seeds are requests the server executes.
    for (name, input) in get("transmission") {
        if name.starts_with("reply-") || name.starts_with("option-") {
            continue;
        }
        let (server, _) = transmission_session(input, false);
        let parsed = server.parse_request(input);
        assert!(parsed.is_ok(), "{name}: {parsed:?}");
    }
    for (name, input) in get("replies") {
        let mut r = crate::wire::Reader::new(input);
        let knobs = r.bytes(1).unwrap()[0];
        let req = Request {
            flags: CmdFlags::empty(),
            command: [Command::Read, Command::BlockStatus, Command::Write][usize::from(knobs & 3)],
            cookie: REPLY_COOKIE,
            offset: r.u64().unwrap(),
            length: r.u32().unwrap().into(),
        };
        let mut check = ReplyCheck::new(&req);
        let mut stream = r.rest();
        let mut outcome = None;
        while outcome.is_none() {
            let lim = FrameLimits::default();
            let need = client_need(ClientPhase::Transmission, stream, &lim, |_| {
                simple_data_len(&req)
            });
            let n = need.total().unwrap();
            let (msg, rest) = stream.split_at(n);
            stream = rest;
            let res = match need {
                Need::Message {
                    header_len: 16,
                    body_len,
                } => check.simple(&SimpleReply::parse(msg).unwrap(), body_len),
                _ => check.chunk(
                    &StructuredReplyHeader::parse(msg).unwrap(),
                    &msg[20..],
                    |id| id == 1,
                ),
            };
            match res {
                Ok(a) if a.done => outcome = Some(Ok(check.finish())),
                Ok(_) => {}
                Err(e) => outcome = Some(Err(e)),
            }
        }
        let outcome = outcome.unwrap();
        let hostile = ["wrapping", "overlap", "outside"]
            .iter()
            .any(|h| name.contains(h));
        let error = name.contains("error");
        match outcome {
            Ok(Ok(())) => assert!(!hostile && !error, "{name} accepted"),
            Ok(Err(_)) => assert!(error, "{name}: {outcome:?}"),
            Err(_) => assert!(hostile, "{name}: {outcome:?}"),
        }
    }
}

#[test]
fn seeds_are_real_conversations() {
    let (c2s, s2c) = transcript(ClientHandshake::connect(ClientConfig::new("disk")), 0);
    assert!(c2s.len() > 4 && s2c.len() > 18);
    // replaying the client stream reaches the transmission phase
    let mut s = ServerHandshake::new(server_config(0));
    assert!(matches!(
        s.feed(&c2s, &mut Vec::new()),
        Ok(ServerEvent::Done(_))
    ));
}
