#!/usr/bin/env python3
"""N clients one after the other, each connecting to an NBD server on 127.0.0.1:PORT and
reading its 18-byte greeting: the rate, and connect-to-greeting latency.

    python3 docs/bench/greet.py PORT N
"""
import socket
import sys
import time

port, n = int(sys.argv[1]), int(sys.argv[2])
lat = []
t0 = time.time()
for _ in range(n):
    t = time.time()
    s = socket.create_connection(("127.0.0.1", port))
    s.recv(18)
    lat.append(time.time() - t)
    s.close()
dt = time.time() - t0
lat.sort()
print(f"{n} greetings in {dt:.2f}s = {n / dt:.0f}/s; p50 {lat[n // 2] * 1e3:.2f} ms "
      f"p99 {lat[n * 99 // 100] * 1e3:.2f} ms max {lat[-1] * 1e3:.1f} ms")
