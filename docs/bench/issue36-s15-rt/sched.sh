#!/bin/sh
# Scheduler view of one nbd qd1 run: who wakes whom, sleeps vs preemptions, IPIs.
# usage: ./sched.sh SERVERBUILD MOUNTBUILD OUTDIR TAG  (perf.data in /tmp/s15-rt, not committed)
set -e
S=/work/$1; M=/work/$2; OUT=$3; TAG=$4; mkdir -p $OUT /tmp/s15-rt
uptime > $OUT/load-sched-$TAG.txt
perf record -a -c 1 -o /tmp/s15-rt/sched-$TAG.data \
  -e sched:sched_waking,sched:sched_switch,ipi:ipi_send_cpu,ipi:ipi_send_cpumask,irq_vectors:reschedule_entry,irq_vectors:call_function_single_entry,io_uring:io_uring_cqring_wait \
  -- $S/qpip-bench nbd qd1 --repeat 1 --runtime 5 --size 256M \
     --server-bin $S/qpip-nbd-server --mount-bin $M/qpip-nbd-mount > $OUT/qd1-sched-$TAG.txt 2>&1
perf script -i /tmp/s15-rt/sched-$TAG.data -F comm,cpu,event,trace 2>/dev/null > /tmp/s15-rt/sched-$TAG.txt
