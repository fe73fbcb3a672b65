#!/bin/bash
# 100 MB ttcp runs in 16 KiB messages, interleaved: QP before (B0), QP after (B2), sockets.
OUT=${OUT:-ttcp16}; B0=${B0:-/tmp/rt/b0/qpip-bench}; B2=${B2:-/tmp/rt/b2/qpip-bench}
cd "$OUT" || exit 1
uptime > load.txt
for round in 1 2 3 4 5 6 7; do
  $B0 micro --only qp-16k --count 100 --repeat 1 >> qp-B0.txt
  $B2 micro --only qp-16k --count 100 --repeat 1 >> qp-B2.txt
  $B2 micro --only socket-16k --count 100 --repeat 1 >> socket.txt
done
uptime >> load.txt
