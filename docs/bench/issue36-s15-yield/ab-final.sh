#!/bin/bash
# ab-final.sh OUT ROUNDS EXPERIMENT [args...] (root): `qpip-bench nbd EXPERIMENT --repeat 1`, the
# build in $BASE and the one in $NEW alternating (each directory holds qpip-bench,
# qpip-nbd-server, qpip-nbd-mount), one file per run: OUT/{base,new}-ROUND.txt.
# e.g. BASE=/work/b325 NEW=/work/bnew ab-final.sh lo 4 raw --size 4G
out=$1; rounds=$2; shift 2
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for v in base new; do
    case $v in base) bin=$BASE;; new) bin=$NEW;; esac
    extra=(--server-bin "$bin/qpip-nbd-server")
    case "$1" in qd1|ext2) extra+=(--mount-bin "$bin/qpip-nbd-mount");; esac
    "$bin/qpip-bench" nbd "$@" --repeat 1 "${extra[@]}" > "$out/$v-$r.txt" 2>&1
  done
done
