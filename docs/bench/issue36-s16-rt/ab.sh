#!/bin/bash
# ab.sh OUT ROUNDS EXPERIMENT [args...] (root): `qpip-bench nbd EXPERIMENT --repeat 1` (or, for
# EXPERIMENT micro, `qpip-bench micro --only ROW --repeat 3` for each ROW in $ROWS) with each
# build directory in $BUILDS in turn; $COUNT, if set, is passed as --count (names under /work; each holds qpip-bench,
# qpip-nbd-server, qpip-nbd-mount), one file per run: OUT/BUILD-ROUND.txt, the load first.
# e.g. BUILDS="b325 s16-ung s16-new" ab.sh out/qd1 5 qd1 --runtime 5 --size 256M
out=$1; rounds=$2; shift 2
mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for v in $BUILDS; do
    bin=/work/$v
    uptime > "$out/$v-$r.txt"
    if [ "$1" = micro ]; then
      for row in ${ROWS:-qp-tcp qp-udp socket-tcp socket-udp}; do
        echo "== $row" >> "$out/$v-$r.txt"
        "$bin/qpip-bench" micro --only "$row" --repeat 3 ${COUNT:+--count $COUNT} >> "$out/$v-$r.txt" 2>&1
      done
      continue
    fi
    extra=(--server-bin "$bin/qpip-nbd-server")
    case "$1" in qd1|ext2) extra+=(--mount-bin "$bin/qpip-nbd-mount");; esac
    "$bin/qpip-bench" nbd "$@" --repeat 1 "${extra[@]}" >> "$out/$v-$r.txt" 2>&1
  done
done
