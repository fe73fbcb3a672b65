p='bench/src/micro/mod.rs'
s=open(p).read()
old='''    let repeat = repeat.max(1);
    progress("host overhead, 1-byte messages");'''
new='''    let repeat = repeat.max(1);
    // PROFILING ONLY (not committed): one row, many times.
    if let Ok(which) = std::env::var("QPIP_MICRO_PROFILE") {
        let n: u64 = std::env::var("QPIP_MICRO_N").ok().and_then(|x| x.parse().ok()).unwrap_or(200_000);
        let t0 = Instant::now();
        match which.as_str() {
            "qp-tcp" => { let r = rtt_qp(net, false, n, Waiter::Spin)?; eprintln!("{:?}", (r.us, r.cpu_us)); }
            "sock-tcp" => { let r = rtt_socket(net, false, n, Waiter::Spin)?; eprintln!("{:?}", (r.us, r.cpu_us)); }
            "qp-udp" => { let r = rtt_qp(net, true, n, Waiter::Spin)?; eprintln!("{:?}", (r.us, r.cpu_us)); }
            "sock-udp" => { let r = rtt_socket(net, true, n, Waiter::Spin)?; eprintln!("{:?}", (r.us, r.cpu_us)); }
            "qp-16k" => { for _ in 0..n { let t = ttcp_qp(net, 100_000_000, 16384)?; eprintln!("{}", t.mbps); } }
            "sock-16k" => { for _ in 0..n { let t = ttcp_socket(net, 100_000_000, 16384)?; eprintln!("{}", t.mbps); } }
            _ => {}
        }
        eprintln!("elapsed {:?}", t0.elapsed());
        std::process::exit(0);
    }
    progress("host overhead, 1-byte messages");'''
assert old in s
s=s.replace(old,new,1)
open(p,'w').write(s)
