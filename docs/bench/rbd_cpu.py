#!/usr/bin/env python3
"""What bounds the RBD rows of `qpip-bench nbd raw --rbd-conf` (issue 26): runs the benchmark
and samples, every 0.1 s, the CPU time of scripts/ceph-dev's daemons (OSD, monitor, manager,
from /proc/PID/stat) and of the whole machine (/proc/stat), then prints for every pass of the
qpip-rbd server (the window between its progress lines: "writing" → "reading" → "read ...")
the pass's MB/s and server CPU per GB (qpip-bench's own figures, from those lines) beside the
OSD's and monitor's CPU per GB, the cores each used on average, and the machine's busy cores
(all CPUs, /proc/stat) less those: fio's and everything else's.

    docs/bench/rbd_cpu.py [--ceph-dir /tmp/qpip-ceph] [--out FILE.json] -- \
        ./target/release/qpip-bench nbd raw --size 256M --repeat 3 --rbd-conf /tmp/qpip-ceph/ceph.conf

The benchmark's own output goes to stdout and stderr as it comes; the table follows on stdout.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time

TICK = os.sysconf("SC_CLK_TCK")
DAEMONS = {"osd": "osd.0", "mon": "mon.a", "mgr": "mgr.x"}


def proc_cpu(pid):
    """User + system seconds of process pid (all its threads), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # fields[0] is the state (field 3); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / TICK


def all_procs():
    """{(pid, comm): user + system seconds} of every process, kernel threads included."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                head, rest = f.read().rsplit(")", 1)
        except OSError:
            continue
        comm = head.split("(", 1)[1]
        fields = rest.split()
        out[(int(d), comm)] = (int(fields[11]) + int(fields[12])) / TICK
    return out


def machine_cpu():
    """(busy, total) jiffies of all CPUs."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


def size_bytes(s):
    m = re.fullmatch(r"(\d+)([kKmMgGtT]?)", s)
    n, unit = int(m.group(1)), m.group(2).upper()
    return n << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[unit]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ceph-dir", default=os.environ.get("QPIP_CEPH_DIR", "/tmp/qpip-ceph"))
    ap.add_argument("--out", help="write the passes as JSON here too")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    if not cmd:
        ap.error("no command")
    pids = {}
    for k, d in DAEMONS.items():
        with open(os.path.join(a.ceph_dir, "run", f"{d}.pid")) as f:
            pids[k] = int(f.read().strip())
    size = size_bytes(cmd[cmd.index("--size") + 1]) if "--size" in cmd else 1 << 30

    samples = []
    done = threading.Event()

    def sample():
        while not done.is_set():
            t = time.monotonic()
            cpu = {k: proc_cpu(p) for k, p in pids.items()}
            samples.append((t, cpu, machine_cpu()))
            done.wait(0.1)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    lines = []
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, bufsize=1)
    snaps = {}
    for line in p.stderr:
        t = time.monotonic()
        if "qpip-rbd: " in line:
            # Every process's CPU at the pass boundaries: who used the machine meanwhile.
            snaps[t] = all_procs()
        lines.append((t, line.rstrip("\n")))
        sys.stderr.write(line)
        sys.stderr.flush()
    rc = p.wait()
    done.set()
    th.join()

    def at(t):
        """The sample nearest t."""
        return min(samples, key=lambda s: abs(s[0] - t))

    passes = []
    start = None
    for t, line in lines:
        m = re.search(r"qpip-rbd: pid \d+ on \S+, writing", line)
        if m:
            start = ("write", t)
            continue
        m = re.search(r"qpip-rbd: (write|read) ([\d.]+) MB/s, server ([\d.]+) s/GB", line)
        if m and start and start[0] == m.group(1):
            s0, s1 = at(start[1]), at(t)
            secs = s1[0] - s0[0]
            gb = size / 1e9
            row = {
                "pass": m.group(1),
                "MBps": float(m.group(2)),
                "server_s_per_GB": float(m.group(3)),
                "secs": round(secs, 2),
            }
            for k in pids:
                c0, c1 = s0[1][k], s1[1][k]
                cpu = (c1 - c0) if c0 is not None and c1 is not None else float("nan")
                row[f"{k}_s_per_GB"] = round(cpu / gb, 3)
                row[f"{k}_cores"] = round(cpu / secs, 2) if secs > 0 else float("nan")
            busy = (s1[2][0] - s0[2][0]) / max(1, s1[2][1] - s0[2][1])
            row["machine_busy"] = round(busy, 2)
            # Cores in use: the machine's, the server's (qpip-bench's CPU per GB at its
            # MB/s), and the rest: fio and whatever else ran on the machine.
            cores = busy * os.cpu_count()
            server = row["server_s_per_GB"] * row["MBps"] / 1000
            row["machine_cores"] = round(cores, 2)
            row["server_cores"] = round(server, 2)
            row["rest_cores"] = round(
                cores - server - sum(row[f"{k}_cores"] for k in pids), 2)
            if start[1] in snaps and t in snaps:
                a0, a1 = snaps[start[1]], snaps[t]
                use = {}
                for key, v in a1.items():
                    # Threads of one program add up under its name (kworkers alike).
                    name = key[1].split("/")[0]
                    use[name] = use.get(name, 0) + v - a0.get(key, 0)
                top = sorted(use.items(), key=lambda kv: -kv[1])[:6]
                row["top_cores"] = ", ".join(
                    f"{n} {v / secs:.2f}" for n, v in top if v > 0)
            passes.append(row)
            start = ("read", t) if m.group(1) == "write" else None

    print()
    print(f"qpip-rbd passes ({size >> 20} MiB each; CPU from /proc, every 0.1 s; "
          f"{os.cpu_count()} CPUs; *_cores: CPUs busy on average over the pass, rest: fio "
          f"and everything else on the machine):")
    hdr = ["pass", "MBps", "server_s_per_GB", "server_cores", "osd_s_per_GB", "osd_cores",
           "mon_s_per_GB", "mon_cores", "mgr_s_per_GB", "machine_cores", "rest_cores", "secs"]
    print(" | ".join(hdr))
    for r in passes:
        print(" | ".join(str(r[h]) for h in hdr))
    print("the processes that used most CPU in each pass (cores; processes of one name added):")
    for r in passes:
        print(f"  {r['pass']} {r['MBps']:.0f} MB/s: {r.get('top_cores', '?')}")
    for kind in ("write", "read"):
        rs = [r for r in passes if r["pass"] == kind]
        if rs:
            med = {h: statistics.median(r[h] for r in rs) for h in hdr[1:]}
            print(f"median {kind} ({len(rs)}): " +
                  ", ".join(f"{h} {med[h]:.3g}" for h in hdr[1:]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"cmd": cmd, "size": size, "passes": passes}, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
