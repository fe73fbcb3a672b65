#!/bin/bash
# Issue 36 item 3 (session 14): round trips that spin / busy-poll, old and new build
# interleaved, each run under perf stat (both sides and both NICs are threads of the one
# process, so the counts are per round trip of both sides).
# Usage: OLD=path NEW=path ROUNDS=5 COUNT=100000 ./rtt.sh OUTDIR
OUT=${1:-out}; OLD=${OLD:-/work/base-bin/qpip-bench}; NEW=${NEW:-/tmp/rt/new/qpip-bench}
ROUNDS=${ROUNDS:-5}; COUNT=${COUNT:-100000}; ROWS=${ROWS:-qp-tcp qp-udp}
EV='syscalls:sys_enter_epoll_wait,syscalls:sys_enter_readv,syscalls:sys_enter_writev,syscalls:sys_enter_recvmsg,syscalls:sys_enter_sendmsg,syscalls:sys_enter_recvfrom,syscalls:sys_enter_sendto,syscalls:sys_enter_ppoll,syscalls:sys_enter_futex,syscalls:sys_enter_sched_yield,syscalls:sys_enter_clock_gettime,context-switches,task-clock'
mkdir -p "$OUT"; cd "$OUT" || exit 1
for r in $(seq 1 "$ROUNDS"); do
  uptime > load-$r.txt
  for row in $ROWS; do
    for b in OLD NEW; do
      bin=${!b}
      perf stat -x, -e "$EV" -o stat-$row-$b-$r.csv $bin micro --only $row --count $COUNT --repeat 1 > out-$row-$b-$r.txt 2>&1
    done
  done
  for row in $SOCKET_ROWS; do
    perf stat -x, -e "$EV" -o stat-$row-$r.csv $NEW micro --only $row --count $COUNT --repeat 1 > out-$row-$r.txt 2>&1
  done
done
uptime >> load-$ROUNDS.txt
