#!/bin/bash
# Issue 36 item 3: `qpip-bench micro --repeat 1 --json`, before (main's release build in
# /work/base-bin) and after (this branch), interleaved, ROUNDS rounds.
OUT=${OUT:-.}; OLD=${OLD:-/work/base-bin/qpip-bench}; NEW=${NEW:-/tmp/rt/b2/qpip-bench}
ROUNDS=${ROUNDS:-3}
cd "$OUT" || exit 1
for round in $(seq 1 $ROUNDS); do
  for b in OLD NEW; do
    bin=${!b}
    uptime > load-$b-$round.txt
    $bin micro --repeat 1 --json > micro-$b-$round.json 2> micro-$b-$round.err
    uptime >> load-$b-$round.txt
  done
done
