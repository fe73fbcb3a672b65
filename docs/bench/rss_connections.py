#!/usr/bin/env python3
"""Server memory under many connections (issues 18, 24): RSS of qpip-nbd-server with N idle
clients past the handshake, with M unfinished handshakes (slowloris), with B busy fio
clients writing, and with U clients that pipeline 32 READs of 32 MiB and never read the
replies, on a qcow2 export and on the holes of a tmpfs image (reads that go through
registered buffers, not the image's mapping). Prints one line per case.

usage: rss_connections.py SERVER_BIN [--idle 200] [--slow 1000] [--busy 64] [--unread 64]
"""
import argparse, os, socket, struct, subprocess, sys, tempfile, time

NBDMAGIC = 0x4e42444d41474943
IHAVEOPT = 0x49484156454F5054
OPT_GO = 7


def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def threads(pid):
    return len(os.listdir(f"/proc/{pid}/task"))


def recv_exact(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise EOFError
        b += c
    return b


def handshaken(port, name=b"disk"):
    s = socket.create_connection(("127.0.0.1", port))
    recv_exact(s, 18)
    s.sendall(struct.pack(">I", 3))  # fixed newstyle, no zeroes
    data = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
    s.sendall(struct.pack(">QII", IHAVEOPT, OPT_GO, len(data)) + data)
    while True:
        _, _, rtype, length = struct.unpack(">QIII", recv_exact(s, 20))
        recv_exact(s, length)
        if rtype == 1:  # ACK
            return s
        if rtype != 3:  # not INFO
            raise RuntimeError(f"GO refused: {rtype:#x}")


def unread_reads(port, name, n, at):
    """`n` clients on export `name` that each send 32 READs of 32 MiB from `at` and read
    nothing."""
    clients = []
    for _ in range(n):
        s = handshaken(port, name)
        for i in range(32):
            off = at + (i % 2) * (32 << 20)
            s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 0, i, off, 32 << 20))
        clients.append(s)
    return clients


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("server")
    ap.add_argument("--idle", type=int, default=200)
    ap.add_argument("--slow", type=int, default=1000)
    ap.add_argument("--busy", type=int, default=64)
    ap.add_argument("--unread", type=int, default=64)
    a = ap.parse_args()
    port = 11900
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        img = os.path.join(d, "disk.img")
        with open(img, "wb") as f:
            f.truncate(4 << 30)
        qcow = os.path.join(d, "disk.qcow2")
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", qcow, "1G"], check=True)
        srv = subprocess.Popen(
            [a.server, "--export", f"disk={img}", "--export", f"q={qcow}",
             "--listen", f"127.0.0.1:{port}",
             "--max-connections", str(max(a.idle, a.busy, a.unread) + 8), "--log", "error"],
            stdout=subprocess.DEVNULL)
        try:
            time.sleep(1)
            print(f"started: RSS {rss(srv.pid) / 2**20:.1f} MiB, {threads(srv.pid)} threads")
            idle = [handshaken(port) for _ in range(a.idle)]
            time.sleep(1)
            print(f"{a.idle} idle clients past the handshake: RSS {rss(srv.pid) / 2**20:.1f} MiB, "
                  f"{threads(srv.pid)} threads")
            slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(a.slow)]
            time.sleep(1)
            t = time.monotonic()
            s = handshaken(port)
            took = time.monotonic() - t
            print(f"+ {a.slow} sockets that never finish the handshake: RSS "
                  f"{rss(srv.pid) / 2**20:.1f} MiB, {threads(srv.pid)} threads; a new client's "
                  f"handshake took {took * 1000:.1f} ms")
            for x in idle + slow + [s]:
                x.close()
            time.sleep(1)
            fio = subprocess.Popen(
                ["fio", "--name=busy", "--ioengine=nbd", f"--uri=nbd://127.0.0.1:{port}/disk",
                 "--rw=write", "--bs=1M", "--iodepth=16", f"--numjobs={a.busy}",
                 "--size=64M", "--time_based", "--runtime=8", "--group_reporting"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            peak = 0
            while fio.poll() is None:
                peak = max(peak, rss(srv.pid))
                time.sleep(0.2)
            print(f"{a.busy} busy fio clients (1 MiB writes, 16 in flight each): peak RSS "
                  f"{peak / 2**20:.1f} MiB")
            # The busy clients wrote the tmpfs image's first 64 MiB: read holes beyond them.
            for name, what, at in [(b"q", "qcow2", 0), (b"disk", "tmpfs holes", 2 << 30)]:
                base = rss(srv.pid)
                hogs = unread_reads(port, name, a.unread, at)
                peak = base
                for _ in range(15):
                    peak = max(peak, rss(srv.pid))
                    time.sleep(0.2)
                print(f"{a.unread} clients with 32 x 32 MiB READs unread ({what}): RSS "
                      f"{base / 2**20:.1f} -> peak {peak / 2**20:.1f} MiB "
                      f"(asked for {a.unread} GiB)")
                for x in hogs:
                    x.close()
                time.sleep(1)
        finally:
            srv.terminate()
            srv.wait()


if __name__ == "__main__":
    sys.exit(main())
