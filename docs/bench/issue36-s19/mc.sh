#!/bin/bash
# usage: mc.sh BINDIR|qsd [RUNTIME] (root). A mount of a qemu-nbd export, which does not allow
# multi-conn (so one connection), 4 KiB O_DIRECT random reads and writes at iodepth 16 and 1:
# qpip-nbd-mount from BINDIR, or qemu-storage-daemon's FUSE export of the same NBD export.
# SERVER=qpip serves the image with BINDIR's qpip-nbd-server instead (multi-conn: the mount's
# four connections); MOUNT_ARGS are added to qpip-nbd-mount's.
# Prints one line per fio run: "WHAT RW QD IOPS".
set -u
B=$1; T=${2:-3}; D=/dev/shm/s19mc; P=10898
rm -rf $D; mkdir -p $D/mnt
head -c 256M /dev/urandom > $D/img
if [ "${SERVER:-qemu-nbd}" = qpip ]; then
  $B/qpip-nbd-server -b 127.0.0.1 -p $P -x x $D/img 2>/dev/null & Q=$!
else
  qemu-nbd -f raw -x x -p $P -b 127.0.0.1 -t --cache=none --aio=native $D/img & Q=$!
fi
for i in $(seq 50); do nbdinfo nbd://127.0.0.1:$P/x >/dev/null 2>&1 && break; sleep 0.1; done
if [ "$B" = qsd ]; then
  : > $D/mnt/x
  qemu-storage-daemon --blockdev driver=nbd,node-name=n,server.type=inet,server.host=127.0.0.1,server.port=$P,export=x \
    --export type=fuse,id=e,node-name=n,mountpoint=$D/mnt/x,writable=on & M=$!
  sleep 1
else
  $B/qpip-nbd-mount --cache none ${MOUNT_ARGS:-} nbd://127.0.0.1:$P/x $D/mnt & M=$!
  for i in $(seq 50); do [ -e $D/mnt/x ] && break; sleep 0.1; done
fi
for rw in randread randwrite; do for qd in 16 1; do
  iops=$(fio --name=w --filename=$D/mnt/x --ioengine=libaio --iodepth=$qd --direct=1 --bs=4k --rw=$rw \
    --time_based --runtime=$T --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print(round(j["read"]["iops"]+j["write"]["iops"]))')
  echo "$(basename $B)${MOUNT_ARGS:+ $MOUNT_ARGS} $rw $qd $iops"
done; done
kill $M; wait $M 2>/dev/null; kill $Q; wait $Q 2>/dev/null; rm -rf $D
