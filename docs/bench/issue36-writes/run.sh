#!/bin/bash
# Interleaved before/after of `nbd raw`, one connection, loopback and --netns MTU 1500:
#   run.sh OUT BEFORE_DIR AFTER_DIR ROUNDS
# Both builds are driven by the before build's qpip-bench, so only the servers differ.
out=$1; before=$2; after=$3; rounds=${4:-3}; mkdir -p "$out"
for r in $(seq 1 "$rounds"); do
  for b in before after; do
    dir=$before; [ $b = after ] && dir=$after
    for link in loopback netns; do
      extra=""; [ $link = netns ] && extra="--netns --mtu 1500"
      uptime > "$out/load-$link-$b-$r.txt"
      "$before/qpip-bench" nbd raw --repeat 1 $extra --server-bin "$dir/qpip-nbd-server" \
        > "$out/raw-$link-$b-$r.txt" 2>&1
    done
  done
done
