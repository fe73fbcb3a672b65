#!/bin/bash
# Nothing else slower: `nbd qd1` and `nbd raw` (1 and 4 connections) with main's server and
# mount (OLD) and this branch's (NEW), interleaved, three rounds; one qpip-bench (NEW's)
# drives both. B/OLD and B/NEW hold release builds of qpip-bench, qpip-nbd-server, -mount.
OUT=${OUT:-nbd}; B=${B:-/tmp/rt}; TOOL=${TOOL:-$B/NEW/qpip-bench}
cd "$OUT" || exit 1
for round in 1 2 3; do
  for b in OLD NEW; do
    bin=$B/$b
    uptime > load-$b-$round.txt
    $TOOL nbd qd1 --repeat 1 --runtime 5 --size 256M --server-bin $bin/qpip-nbd-server --mount-bin $bin/qpip-nbd-mount > qd1-$b-$round.txt 2>&1
    $TOOL nbd raw --repeat 1 --size 512M --server-bin $bin/qpip-nbd-server > raw1-$b-$round.txt 2>&1
    $TOOL nbd raw --repeat 1 --size 512M --jobs 4 --server-bin $bin/qpip-nbd-server > raw4-$b-$round.txt 2>&1
    uptime >> load-$b-$round.txt
  done
done
echo finished > done
