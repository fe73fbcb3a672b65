#!/bin/bash
# Issue 33 item 5: the NIC core before (a92bb55) and after (HEAD), interleaved.
cd /tmp/b33
for round in 1 2; do
  for b in OLD NEW; do
    /tmp/$b/qpip-bench micro --repeat 3 > micro-$b-$round.txt 2>&1
    /tmp/NEW/qpip-bench nbd qd1 --repeat 1 --runtime 5 --size 256M --server-bin /tmp/$b/qpip-nbd-server --mount-bin /tmp/$b/qpip-nbd-mount > qd1-$b-$round.txt 2>&1
    /tmp/NEW/qpip-bench nbd raw --repeat 1 --size 512M --server-bin /tmp/$b/qpip-nbd-server > raw1-$b-$round.txt 2>&1
    /tmp/NEW/qpip-bench nbd raw --repeat 1 --size 512M --jobs 4 --server-bin /tmp/$b/qpip-nbd-server > raw4-$b-$round.txt 2>&1
    /tmp/NEW/qpip-bench nbd ext2 --repeat 1 --stacks qpip --no-plot --server-bin /tmp/$b/qpip-nbd-server --mount-bin /tmp/$b/qpip-nbd-mount > ext2-$b-$round.txt 2>&1
  done
done
echo finished > done
