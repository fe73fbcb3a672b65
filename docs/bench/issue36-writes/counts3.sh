#!/bin/bash
# counts3.sh OUT LINK ROUNDS RW NAME=SERVER...: interleaved per-thread perf stat rounds of several builds
out=$1; link=$2; rounds=$3; rw=$4; shift 4; mkdir -p $out
n=""; [ $link = netns ] && n=1
for r in $(seq 1 $rounds); do for spec in "$@"; do name=${spec%%=*}; srv=${spec#*=}
  uptime > $out/load-$link-$name-$r.txt
  NETNS=$n LOOPS=4 "$(dirname "$0")/prof.sh" $srv $out/$link-$name-$r $rw > $out/$link-$name-$r.mbs 2>&1
done; done
