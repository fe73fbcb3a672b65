#!/bin/bash
# Issue 36 item 3 (session 14): old and new build interleaved, one command at a time.
#   micro: the whole table (--repeat 1 --json) per build and round;
#   qd1:   nbd qd1 through the mount, each build's server and mount driven by the same tool.
# Usage: OLD=dir NEW=dir ROUNDS=3 ./ab.sh OUTDIR [micro|qd1]...
OUT=${1:-out}; shift; OLD=${OLD:-/work/base-bin}; NEW=${NEW:-/tmp/rt/new}; ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT"; cd "$OUT" || exit 1
for what in "$@"; do
  for r in $(seq 1 "$ROUNDS"); do
    for b in OLD NEW; do
      dir=${!b}
      uptime > load-$what-$b-$r.txt
      case $what in
        micro) $dir/qpip-bench micro --repeat 1 --json > micro-$b-$r.json 2> micro-$b-$r.err ;;
        qd1) $NEW/qpip-bench nbd qd1 --repeat 1 --runtime 5 --size 256M --json \
               --server-bin $dir/qpip-nbd-server --mount-bin $dir/qpip-nbd-mount \
               > qd1-$b-$r.json 2> qd1-$b-$r.err ;;
      esac
    done
  done
done
