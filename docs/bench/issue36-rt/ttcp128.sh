#!/bin/bash
# 1 GB ttcp runs in 128 KiB messages, QP (this branch) and sockets interleaved, 7 rounds.
OUT=${OUT:-ttcp128}; B=${B:-/tmp/rt/b3/qpip-bench}
cd "$OUT" || exit 1
uptime > load.txt
for round in 1 2 3 4 5 6 7; do
  $B micro --only qp-128k --count 1000 --repeat 1 >> qp.txt
  $B micro --only socket-128k --count 1000 --repeat 1 >> socket.txt
done
uptime >> load.txt
