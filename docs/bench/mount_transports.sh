#!/usr/bin/env bash
# Buffered 1 GiB write + fsync and O_DIRECT write through the mount, per FUSE transport; CPU of the mount process.
set -u
R=/work/main/target/release
W=/dev/shm/wcmp; rm -rf $W; mkdir -p $W/mnt
truncate -s 1200M $W/d.img
$R/qpip-nbd-server --export d=$W/d.img -l 127.0.0.1:10971 --log error >/dev/null 2>&1 & S=$!
sleep 0.5
for round in 1 2 3; do
for t in uring dev; do
  $R/qpip-nbd-mount --fuse-transport $t nbd://127.0.0.1:10971/d $W/mnt > $W/m.log 2>&1 & M=$!
  for i in $(seq 50); do [ -e $W/mnt/d ] && break; sleep 0.1; done
  c0=$(awk '{print $14+$15}' /proc/$M/stat)
  r=$(dd if=/dev/zero of=$W/mnt/d bs=1M count=1024 conv=fsync,notrunc 2>&1 | tail -1 | awk '{print $(NF-1)}')
  c1=$(awk '{print $14+$15}' /proc/$M/stat)
  r2=$(dd if=/dev/zero of=$W/mnt/d bs=1M count=1024 oflag=direct conv=notrunc 2>&1 | tail -1 | awk '{print $(NF-1)}')
  c2=$(awk '{print $14+$15}' /proc/$M/stat)
  echo "round $round $t: buffered+fsync ${r} MB/s, mount CPU $(( (c1-c0) ))0 ms/GiB; O_DIRECT ${r2} MB/s, mount CPU $(( (c2-c1) ))0 ms/GiB"
  fusermount3 -u $W/mnt; wait $M
done; done
kill $S; wait $S; rm -rf $W
