#!/bin/bash
# run.sh TAG ROUNDS "VARIANTS" (root): prof.sh for each variant in turn, ROUNDS times, into
# ${OUT:-out}/TAG-ROUND-VARIANT; m = main (/work/s20-m), nbdkit, else /work/s20-e/srv-VARIANT
# (out/README.txt). NETNS=1 (namespace s14v of ../issue36-s14-veth/setup-netns.sh), BS, RW: as ../issue36-s14-veth/prof.sh.
tag=$1; rounds=$2; vs=$3
for r in $(seq $rounds); do for v in $vs; do case $v in m) b=/work/s20-m/qpip-nbd-server;; nbdkit) b=nbdkit;; *) b=/work/s20-e/srv-$v;; esac; o=${OUT:-out}/$tag-$r-$v; $(dirname $0)/../issue36-s14-veth/prof.sh $b $o ${RW:-read} >$o.mbs 2>&1; s=$(grep -v "^#" $o/srv-stat.txt | awk -F, '$2!="<not counted>" && $4=="task-clock" {s+=$2} END{print s}'); f=$(grep -v "^#" $o/fio-stat.txt | awk -F, '$3=="task-clock"{print $1}'); w=$(grep -v "^#" $o/srv-stat.txt | awk -F, '$4=="syscalls:sys_enter_writev" {s+=$2} END{print s}'); echo "$tag $r $v $(tail -1 $o.mbs) srv_ms=$s fio_ms=$f writev=$w"; done; done
