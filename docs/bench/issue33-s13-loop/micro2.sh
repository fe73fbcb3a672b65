#!/bin/bash
# Issue 33, session 13: more micro rounds after run.sh (see BENCHMARKS.md); outputs in micro2/.
OUT=/tmp/s13-loop/micro2; mkdir -p $OUT; cd $OUT
for round in 1 2 3 4; do for b in before after; do
  if [ $b = before ]; then bin=/work/base-bin; else bin=/work/wt-loop/target/release; fi
  uptime > load-$b-$round.txt
  $bin/qpip-bench micro --repeat 3 > micro-$b-$round.txt 2>&1
  uptime >> load-$b-$round.txt
done; done
echo finished > done
