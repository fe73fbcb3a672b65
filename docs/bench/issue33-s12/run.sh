#!/bin/bash
# Issue 33, session 12: the NIC core before and after, interleaved, three rounds. Each
# directory in BUILDS (under B) holds release builds of qpip-bench, qpip-nbd-server and
# qpip-nbd-mount. Two runs were made (outputs beside this script):
#   three-builds/: BUILDS="OLD C23 NEW2" -- OLD = 548a534 (main before), C23 = c211d51 (per-CQ
#     poll window + io_uring exclusion), NEW2 = 922aab8 (+ the one sleep site);
#   final/: BUILDS="OLD FINAL" TOOL=$B/NEW2/qpip-bench -- FINAL = cad2cbb (per-CQ window
#     reverted).
# The nbd runs use one qpip-bench (TOOL) for every build, so only the measured binaries
# differ; micro runs in-process, so each build's own tool.
OUT=${OUT:-/tmp/s12/bench}
B=${B:-/tmp/s12}
BUILDS=${BUILDS:-"OLD C23 NEW2"}
TOOL=${TOOL:-$B/NEW2/qpip-bench}
mkdir -p "$OUT" && cd "$OUT" || exit 1
for round in 1 2 3; do
  for b in $BUILDS; do
    bin=$B/$b
    uptime > load-$b-$round.txt
    $bin/qpip-bench micro --repeat 3 > micro-$b-$round.txt 2>&1
    $TOOL nbd qd1 --repeat 1 --runtime 5 --size 256M --server-bin $bin/qpip-nbd-server --mount-bin $bin/qpip-nbd-mount > qd1-$b-$round.txt 2>&1
    $TOOL nbd raw --repeat 1 --size 512M --server-bin $bin/qpip-nbd-server > raw1-$b-$round.txt 2>&1
    $TOOL nbd raw --repeat 1 --size 512M --jobs 4 --server-bin $bin/qpip-nbd-server > raw4-$b-$round.txt 2>&1
    $TOOL nbd ext2 --repeat 1 --stacks qpip --no-plot --server-bin $bin/qpip-nbd-server --mount-bin $bin/qpip-nbd-mount > ext2-$b-$round.txt 2>&1
    uptime >> load-$b-$round.txt
  done
done
echo finished > done
