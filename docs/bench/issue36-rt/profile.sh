#!/bin/bash
# Issue 36 item 3: system calls, context switches and CPU per round trip / per 16 KiB message,
# per build, under perf stat (both sides and both NICs are threads of the one process).
# B0 = main (1f3948d) + `micro --only` (44e1814): "before"; B2 = this branch: "after".
# Usage: OUT=dir B0=path B2=path ./profile.sh; zero counters were dropped from the CSVs after.
OUT=${OUT:-.}; B0=${B0:-/tmp/rt/b0/qpip-bench}; B2=${B2:-/tmp/rt/b2/qpip-bench}
EV='syscalls:sys_enter_*,context-switches,task-clock'
cd "$OUT" || exit 1
for round in 1 2 3; do
  for b in B0 B2; do
    bin=${!b}
    for row in qp-tcp qp-udp; do
      perf stat -x, -e "$EV" -o stat-$row-$b-$round.csv $bin micro --only $row --count 100000 --repeat 1 > out-$row-$b-$round.txt 2>&1
    done
    perf stat -x, -e "$EV" -o stat-qp-16k-$b-$round.csv $bin micro --only qp-16k --count 100 --repeat 1 > out-qp-16k-$b-$round.txt 2>&1
  done
  for row in socket-tcp socket-udp; do
    perf stat -x, -e "$EV" -o stat-$row-$round.csv $B2 micro --only $row --count 100000 --repeat 1 > out-$row-$round.txt 2>&1
  done
  perf stat -x, -e "$EV" -o stat-socket-16k-$round.csv $B2 micro --only socket-16k --count 100 --repeat 1 > out-socket-16k-$round.txt 2>&1
done
uptime > load.txt
