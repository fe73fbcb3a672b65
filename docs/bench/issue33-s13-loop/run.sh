#!/bin/bash
# Issue 33, session 13: the NIC thread as one loop over one state machine, before and after,
# interleaved, three rounds. BEFORE and AFTER hold release builds of qpip-bench,
# qpip-nbd-server and qpip-nbd-mount (before: main at 1f3948d, /work/base-bin; after: this
# branch). micro runs in-process, so each build's own tool, under perf stat (system calls,
# context switches and CPU of the whole process); qd1 uses BEFORE's qpip-bench for both, so
# only the server and mount differ.
OUT=${OUT:-/tmp/s13-loop/bench}
BEFORE=${BEFORE:-/work/base-bin}
AFTER=${AFTER:-/work/wt-loop/target/release}
EVENTS='raw_syscalls:sys_enter,syscalls:sys_enter_ppoll,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_futex,syscalls:sys_enter_sched_yield,context-switches,task-clock'
mkdir -p "$OUT" && cd "$OUT" || exit 1
for round in 1 2 3; do
  for b in before after; do
    if [ $b = before ]; then bin=$BEFORE; else bin=$AFTER; fi
    uptime > load-$b-$round.txt
    perf stat -x, -o perf-micro-$b-$round.csv -e "$EVENTS" \
      $bin/qpip-bench micro --repeat 3 > micro-$b-$round.txt 2>&1
    $BEFORE/qpip-bench nbd qd1 --repeat 1 --runtime 5 --size 256M \
      --server-bin $bin/qpip-nbd-server --mount-bin $bin/qpip-nbd-mount > qd1-$b-$round.txt 2>&1
    uptime >> load-$b-$round.txt
  done
done
echo finished > done
