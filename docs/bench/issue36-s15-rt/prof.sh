#!/bin/sh
# perf profile (timer, -F 999 -g -a) and syscall/context-switch counts per thread for one build.
# usage: ./prof.sh b325|brt OUTDIR TAG   (perf.data files go to /tmp/s15, not committed)
set -e
b=$1; OUT=$2; TAG=$3; B=/work/$b; mkdir -p $OUT /tmp/s15
Q="$B/qpip-bench nbd qd1 --repeat 1 --runtime 5 --size 256M --server-bin $B/qpip-nbd-server --mount-bin $B/qpip-nbd-mount"
uptime > $OUT/load-$TAG.txt
perf record -F 999 -g -a -o /tmp/s15/cpu-$TAG.data -- $Q > $OUT/qd1-cpu-$TAG.txt 2>&1
uptime >> $OUT/load-$TAG.txt
perf record -a -c 1 -o /tmp/s15/sys-$TAG.data \
  -e 'syscalls:sys_enter_readv,syscalls:sys_enter_recvfrom,syscalls:sys_enter_recvmsg,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_epoll_pwait,syscalls:sys_enter_writev,syscalls:sys_enter_sendmsg,syscalls:sys_enter_sendto,syscalls:sys_enter_futex,syscalls:sys_enter_ppoll,syscalls:sys_enter_read,syscalls:sys_enter_write,context-switches' \
  -- $Q > $OUT/qd1-sys-$TAG.txt 2>&1
uptime >> $OUT/load-$TAG.txt
