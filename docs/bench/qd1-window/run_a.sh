#!/bin/bash
# (a) the per-CQ window against main (OLD = /work/base-bin, main at 1f3948d), interleaved,
# three rounds: `qpip-bench nbd qd1` (8 s runs, 1 GiB image; main's qpip-bench for both, only
# the measured server and mount differ) and qd1_short.sh (3 s runs, 256 MiB image, one round
# each time: qsd-nbdkit, OLD, NEW). Root. OUT: where the outputs go.
OUT=${OUT:-.}; OLD=${OLD:-/work/base-bin}; NEW=${NEW:-/tmp/win/NEW}; TOOL=${TOOL:-$OLD/qpip-bench}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT" && cd "$OUT" || exit 1
for round in 1 2 3; do
  for b in OLD NEW; do
    bin=${!b}
    uptime > load-qd1-$b-$round.txt
    $TOOL nbd qd1 --repeat 1 --server-bin $bin/qpip-nbd-server --mount-bin $bin/qpip-nbd-mount > qd1-$b-$round.txt 2>&1
    uptime >> load-qd1-$b-$round.txt
  done
  ROUNDS=1 "$here/qd1_short.sh" OLD=$OLD NEW=$NEW > short-$round.txt 2>&1
done
echo finished > done
