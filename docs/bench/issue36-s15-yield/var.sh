#!/bin/bash
# var.sh OUT ROUNDS EXPERIMENT [args...] (root): like ab-final.sh over the variants in
# $VARIANTS (default "base yb0 yb1m"): base = the build in $BASE; yb0, yb1m = the test build in
# $VAR (branch s15-yield with the uncommitted QPIP_S15_YB switch: stop after that many bytes
# of file bodies, 0 = after each) with QPIP_S15_YB=0 and =1048576.
out=$1; rounds=$2; shift 2
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for v in ${VARIANTS:-base yb0 yb1m}; do
    case $v in
      base) bin=$BASE; env="";;
      yb0) bin=$VAR; env="QPIP_S15_YB=0";;
      yb1m) bin=$VAR; env="QPIP_S15_YB=1048576";;
    esac
    env $env "$bin/qpip-bench" nbd "$@" --repeat 1 --server-bin "$bin/qpip-nbd-server" > "$out/$v-$r.txt" 2>&1
  done
done
