#!/bin/bash
# qd1ab.sh BINDIR OUT RW PIN [RUNTIME] (root): one plain QD1 run through qpip-nbd-mount
# --cache none over qpip-nbd-server (both from BINDIR) on a 256 MiB random image in /dev/shm:
# fio psync 4 KiB RW (randread|randwrite), RUNTIME s (5); PIN=1 pins each FUSE ring thread to
# its queue's CPU first. OUT/fio.txt (fio terse), OUT/cpu.txt (server and mount CPU, µs, from
# every thread's schedstat). Rounds: for r in ...; for b in BUILDS; qd1ab.sh /work/$b DIR/$b-$rw-$r
# $rw 0 3; then python3 qsum.py DIR BUILD...
B=$1; OUT=$2; RW=$3; PIN=$4; RT=${5:-5}
mkdir -p $OUT
. "$(dirname "$0")/stack.sh"
stack_up "$B"
if [ "$PIN" = 1 ]; then
  for t in /proc/$M/task/*; do n=$(cat $t/comm); case $n in fuse-ring-*) q=${n#fuse-ring-}; q=${q%%.*}; taskset -p -c $q ${t##*/} >/dev/null;; esac; done
fi
fio --name=w --filename=$D/mnt/x --ioengine=psync --iodepth=1 --direct=1 --bs=4k --rw=$RW --time_based --runtime=1 >/dev/null
c0=$(cat /proc/$S/task/*/schedstat | awk '{s+=$1} END {print s}') ; m0=$(cat /proc/$M/task/*/schedstat | awk '{s+=$1} END {print s}')
fio --name=w --filename=$D/mnt/x --ioengine=psync --iodepth=1 --direct=1 --bs=4k --rw=$RW --time_based --runtime=$RT --output-format=terse > $OUT/fio.txt
c1=$(cat /proc/$S/task/*/schedstat | awk '{s+=$1} END {print s}') ; m1=$(cat /proc/$M/task/*/schedstat | awk '{s+=$1} END {print s}')
echo "$(( (c1-c0)/1000 )) $(( (m1-m0)/1000 ))" > $OUT/cpu.txt
stack_down
