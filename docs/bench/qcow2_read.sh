#!/bin/bash
# fio 256k QD16 sequential reads of an image served by SRV (qpip-nbd-server): MB/s and the server's CPU s/GB.
# Usage: docs/bench/qcow2_read.sh SRV IMAGE [PORT]   (docs/bench/qcow2-read-spares.txt)
SRV=$1; IMG=$2; PORT=${3:-19820}
$SRV -e d=$IMG -l 127.0.0.1:$PORT 2>/dev/null & pid=$!
sleep 0.7
t0=$(awk '{print $14+$15}' /proc/$pid/stat)
out=$(fio --name=r --ioengine=nbd --uri=nbd://127.0.0.1:$PORT/d --rw=read --bs=256k --iodepth=16 --size=512M --loops=4 --output-format=terse 2>/dev/null)
t1=$(awk '{print $14+$15}' /proc/$pid/stat)
kill $pid; wait $pid 2>/dev/null
echo "$out" | awk -F';' -v c=$((t1-t0)) '{mb=$7/1000; printf "read %.0f MB/s, server %.3f s/GB\n", mb, c/100/2.147}'
