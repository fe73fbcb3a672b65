#!/bin/bash
# (b) the tool's short runs against the plain script's, interleaved, three rounds, one build
# (NEW): `qpip-bench nbd qd1 --runtime 3 --size 256M` then qd1_short.sh (3 s, 256 MiB).
OUT=${OUT:-.}; NEW=${NEW:-/tmp/win/NEW}; TOOL=${TOOL:-/work/base-bin/qpip-bench}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT" && cd "$OUT" || exit 1
for round in 1 2 3; do
  $TOOL nbd qd1 --repeat 1 --runtime 3 --size 256M --server-bin $NEW/qpip-nbd-server --mount-bin $NEW/qpip-nbd-mount > tool-short-$round.txt 2>&1
  ROUNDS=1 "$here/qd1_short.sh" NEW=$NEW > script-$round.txt 2>&1
done
echo finished > done
