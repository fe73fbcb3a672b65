#!/usr/bin/env python3
"""Plain file copies through qpip-nbd-mount in each --cache mode (issue 36 item 3: the
mount's write cost in its default mode). For each mode, ROUNDS rounds alternating the modes:
write SIZE MiB into the mounted file with dd (blocks of BS, conv=fsync: the copy is done when
the server has it), drop caches, read it back with dd (blocks of BS, buffered). Wall time, MB/s, and
every thread's CPU per GB: dd, the mount, the server, and the kernel threads (writeback
flushers, workers), from /proc. Prints each run and the medians. Root.

Usage: sudo docs/bench/mount_copy.py [ROUNDS=5] [SIZE_MIB=1024] [BIN_DIR=target/release] [MODES=writeback,none] [BS=1M]
"""
import os, statistics, subprocess, sys, tempfile, time

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
size = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
bin_dir = sys.argv[3] if len(sys.argv) > 3 else "target/release"
modes = (sys.argv[4] if len(sys.argv) > 4 else "writeback,none").split(",")
bs = sys.argv[5] if len(sys.argv) > 5 else "1M"
count = size * 1048576 // (int(bs[:-1]) * {"K": 1024, "M": 1048576}[bs[-1]])
TCK = os.sysconf("SC_CLK_TCK")
PORT = 10996


def stat(pid):
    with open(f"/proc/{pid}/stat") as f:
        s = f.read()
    fields = s[s.rindex(")") + 2:].split()
    # fields[1] = ppid, [11] utime, [12] stime, [13] cutime, [14] cstime
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TCK


def kthreads_cpu():
    total = 0.0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            ppid, cpu = stat(d)
        except (OSError, ValueError):
            continue
        if ppid == 2 or d == "2":
            total += cpu
    return total


def timed(cmd):
    """Runs cmd; returns (wall seconds, its CPU seconds)."""
    r0 = os.times()
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t = time.monotonic() - t0
    r1 = os.times()
    return t, (r1.children_user - r0.children_user) + (r1.children_system - r0.children_system)


def run(work, mode):
    mnt = os.path.join(work, "mnt")
    m = subprocess.Popen([f"{bin_dir}/qpip-nbd-mount", "--cache", mode,
                          f"nbd://127.0.0.1:{PORT}/d", mnt],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    f = os.path.join(mnt, "d")
    for _ in range(100):
        if os.path.exists(f):
            break
        time.sleep(0.05)
    out = {}
    for what, cmd in (
        ("write", ["dd", f"if={work}/src", f"of={f}", f"bs={bs}", f"count={count}", "conv=fsync,notrunc"]),
        ("read", ["dd", f"if={f}", "of=/dev/null", f"bs={bs}", f"count={count}"]),
    ):
        subprocess.run(["sync"])
        with open("/proc/sys/vm/drop_caches", "w") as dc:
            dc.write("3\n")
        s0, m0, k0 = stat(server.pid)[1], stat(m.pid)[1], kthreads_cpu()
        wall, dd_cpu = timed(cmd)
        s1, m1, k1 = stat(server.pid)[1], stat(m.pid)[1], kthreads_cpu()
        gb = size * 1.048576 / 1000
        out[what] = {
            "MB/s": size * 1.048576 / wall,
            "dd": dd_cpu / gb, "mount": (m1 - m0) / gb, "server": (s1 - s0) / gb,
            "kthreads": (k1 - k0) / gb,
        }
        out[what]["all"] = sum(out[what][k] for k in ("dd", "mount", "server", "kthreads"))
    subprocess.run(["fusermount3", "-u", mnt])
    m.wait()
    return out


work = tempfile.mkdtemp(dir="/dev/shm", prefix="qpip-mcopy.")
os.mkdir(os.path.join(work, "mnt"))
subprocess.run(["dd", "if=/dev/urandom", f"of={work}/src", "bs=1M", f"count={size}"],
               check=True, stderr=subprocess.DEVNULL)
subprocess.run(["truncate", "-s", f"{size}M", f"{work}/d.img"], check=True)
server = subprocess.Popen([f"{bin_dir}/qpip-nbd-server", "--export", f"d={work}/d.img",
                           "-l", f"127.0.0.1:{PORT}", "--log", "error"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
time.sleep(0.5)
results = {(m, w): [] for m in modes for w in ("write", "read")}
try:
    for r in range(rounds):
        for mode in modes:
            o = run(work, mode)
            for w, v in o.items():
                results[(mode, w)].append(v)
                print(f"round {r + 1} {mode:9} {w:5} {v['MB/s']:7.0f} MB/s  CPU s/GB: all {v['all']:.2f} = "
                      f"dd {v['dd']:.2f} + mount {v['mount']:.2f} + server {v['server']:.2f} + "
                      f"kernel threads {v['kthreads']:.2f}", flush=True)
    print(f"\nmedians of {rounds} rounds, {size} MiB in blocks of {bs}, {os.uname().release}, load {os.getloadavg()[0]:.1f}:")
    for (mode, w), vs in results.items():
        med = {k: statistics.median(v[k] for v in vs) for k in vs[0]}
        print(f"{mode:9} {w:5} {med['MB/s']:7.0f} MB/s  CPU s/GB: all {med['all']:.2f} = dd {med['dd']:.2f} + "
              f"mount {med['mount']:.2f} + server {med['server']:.2f} + kernel threads {med['kthreads']:.2f}")
finally:
    server.kill()
    subprocess.run(["rm", "-rf", work])
