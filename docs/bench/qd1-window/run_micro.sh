#!/bin/bash
# micro before (OLD = main's build) and after (NEW), interleaved, three rounds.
OUT=${OUT:-.}; OLD=${OLD:-/work/base-bin}; NEW=${NEW:-/tmp/win/NEW}
mkdir -p "$OUT" && cd "$OUT" || exit 1
for round in 1 2 3; do
  for b in OLD NEW; do
    bin=${!b}
    uptime > load-$b-$round.txt
    $bin/qpip-bench micro --repeat 3 > micro-$b-$round.txt 2>&1
    uptime >> load-$b-$round.txt
  done
done
echo finished > done
