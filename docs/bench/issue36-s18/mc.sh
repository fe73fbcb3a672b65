#!/bin/bash
# usage: mc.sh (root). The four fio lines: qpip-nbd-mount QD16, QD1; qemu-storage-daemon QD16, QD1.
# mount of a qemu-nbd export (no multi-conn) at iodepth 16: qpip-nbd-mount vs qemu-storage-daemon
B=/work/s18-yl; D=/dev/shm/s18mc; rm -rf $D; mkdir -p $D/mnt
head -c 256M /dev/urandom > $D/img
qemu-nbd -f raw -x x -p 10898 -b 127.0.0.1 -t $D/img & Q=$!
sleep 0.5
nbdinfo nbd://127.0.0.1:10898/x 2>&1 | grep -i multi
$B/qpip-nbd-mount --cache none nbd://127.0.0.1:10898/x $D/mnt & M=$!
for i in $(seq 50); do [ -e $D/mnt/x ] && break; sleep 0.1; done
fio --name=w --filename=$D/mnt/x --ioengine=libaio --iodepth=16 --direct=1 --bs=4k --rw=randread --time_based --runtime=3 2>&1 | grep -E "IOPS"
fio --name=w --filename=$D/mnt/x --ioengine=libaio --iodepth=1 --direct=1 --bs=4k --rw=randread --time_based --runtime=3 2>&1 | grep -E "IOPS"
kill $M; sleep 0.5
: > $D/fuse-file
qemu-storage-daemon --blockdev driver=nbd,node-name=n,server.type=inet,server.host=127.0.0.1,server.port=10898,export=x --export type=fuse,id=e,node-name=n,mountpoint=$D/fuse-file,writable=on & S=$!
sleep 1
fio --name=w --filename=$D/fuse-file --ioengine=libaio --iodepth=16 --direct=1 --bs=4k --rw=randread --time_based --runtime=3 2>&1 | grep -E "IOPS"
fio --name=w --filename=$D/fuse-file --ioengine=libaio --iodepth=1 --direct=1 --bs=4k --rw=randread --time_based --runtime=3 2>&1 | grep -E "IOPS"
kill $S; sleep 0.5; kill $Q; wait; rm -rf $D
