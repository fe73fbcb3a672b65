#!/bin/bash
# qd1sys.sh BINDIR OUT (root): the server's system calls (statx, mincore, all) per 20 000
# QD1 4 KiB READs through the mount, counted with perf stat into OUT/stat.txt.
B=$1; OUT=$2
mkdir -p $OUT
. "$(dirname "$0")/stack.sh"
stack_up "$B"
perf stat -e 'syscalls:sys_enter_statx,syscalls:sys_enter_mincore,raw_syscalls:sys_enter' -p $S -o $OUT/stat.txt -- fio --name=w --filename=$D/mnt/x --ioengine=psync --iodepth=1 --direct=1 --bs=4k --rw=randread --number_ios=20000 --output-format=terse > $OUT/fio.txt
stack_down
