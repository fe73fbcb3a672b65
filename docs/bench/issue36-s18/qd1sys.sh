#!/bin/bash
# qd1sys.sh BINDIR OUT (root): the server's system calls (statx, mincore, all) per 20 000
# QD1 4 KiB READs through the mount, counted with perf stat into OUT/stat.txt.
B=$1; OUT=$2
mkdir -p $OUT; D=/dev/shm/s18q; rm -rf $D; mkdir -p $D/mnt
head -c 256M /dev/urandom > $D/img
$B/qpip-nbd-server -q --listen 127.0.0.1:10899 -e x=$D/img & S=$!
sleep 0.5
$B/qpip-nbd-mount --cache none nbd://127.0.0.1:10899/x $D/mnt & M=$!
for i in $(seq 50); do [ -e $D/mnt/x ] && break; sleep 0.1; done
perf stat -e 'syscalls:sys_enter_statx,syscalls:sys_enter_mincore,raw_syscalls:sys_enter' -p $S -o $OUT/stat.txt -- fio --name=w --filename=$D/mnt/x --ioengine=psync --iodepth=1 --direct=1 --bs=4k --rw=randread --number_ios=20000 --output-format=terse > $OUT/fio.txt
kill $M; sleep 0.5; kill $S; wait
rm -rf $D
