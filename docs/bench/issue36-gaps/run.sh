#!/bin/bash
# Part 0 (issue 33 item 5): the extra system call per host sleep, before (OLD = main at
# 46d5179) and after (NEW = s12-gaps), interleaved, three rounds. B/OLD and B/NEW hold release
# builds of qpip-bench, qpip-nbd-server and qpip-nbd-mount; the nbd rows use NEW's qpip-bench
# for both (only the measured binaries differ), micro runs in-process (each build's own).
OUT=${OUT:-.}; B=${B:-/tmp/s12/gaps}; BUILDS=${BUILDS:-"OLD NEW"}
TOOL=${TOOL:-$B/NEW/qpip-bench}
mkdir -p "$OUT" && cd "$OUT" || exit 1
for round in 1 2 3; do
  for b in $BUILDS; do
    bin=$B/$b
    uptime > load-$b-$round.txt
    $bin/qpip-bench micro --repeat 3 > micro-$b-$round.txt 2>&1
    $TOOL nbd qd1 --repeat 1 --runtime 5 --size 256M --server-bin $bin/qpip-nbd-server --mount-bin $bin/qpip-nbd-mount > qd1-$b-$round.txt 2>&1
    $TOOL nbd raw --repeat 1 --size 512M --server-bin $bin/qpip-nbd-server > raw1-$b-$round.txt 2>&1
    uptime >> load-$b-$round.txt
  done
done
echo finished > done
