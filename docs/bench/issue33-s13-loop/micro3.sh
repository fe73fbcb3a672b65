#!/bin/bash
# Issue 33, session 13: micro rounds with the after build first; outputs in micro3/.
# after first in each round, to see the order effect
OUT=/tmp/s13-loop/micro3; mkdir -p $OUT; cd $OUT
EVENTS='raw_syscalls:sys_enter,syscalls:sys_enter_ppoll,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_futex,context-switches,task-clock'
for round in 1 2 3 4; do for b in after before; do
  if [ $b = before ]; then bin=/work/base-bin; else bin=/work/wt-loop/target/release; fi
  uptime > load-$b-$round.txt
  perf stat -x, -o perf-micro-$b-$round.csv -e "$EVENTS" $bin/qpip-bench micro --repeat 3 > micro-$b-$round.txt 2>&1
  uptime >> load-$b-$round.txt
done; done
echo finished > done
