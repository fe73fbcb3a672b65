#!/usr/bin/env python3
"""A connect-and-reset flood against an NBD server on 127.0.0.1:PORT: N clients, one after the
other, each connecting and closing with SO_LINGER 0 (a reset), as a port scanner does.
Prints the rate and the connect latencies; a connect over 500 ms is a SYN the server's
listen queue dropped (retransmitted after 1 s). Issue 34, M1.

    python3 docs/bench/flood.py PORT N
"""
import socket
import struct
import sys
import time

port, n = int(sys.argv[1]), int(sys.argv[2])
lat = []
t0 = time.time()
for _ in range(n):
    t = time.time()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.connect(("127.0.0.1", port))
    lat.append(time.time() - t)
    s.close()
dt = time.time() - t0
lat.sort()
print(f"{n} in {dt:.2f}s = {n / dt:.0f}/s; connect p50 {lat[n // 2] * 1e3:.2f} ms "
      f"p99 {lat[n * 99 // 100] * 1e3:.1f} ms max {lat[-1] * 1e3:.0f} ms; "
      f"over 500 ms: {sum(1 for x in lat if x > 0.5)}")
