#!/bin/sh
# Issue 36's table again, one command after another on an otherwise idle machine (session 13).
# usage: docs/bench/issue36-s13-quiet/run.sh BINDIR OUTDIR   (BINDIR: release qpip-bench and
# the qpip-nbd-server / qpip-nbd-mount beside it; root for --netns)
set -eu
B=$1; O=$2; mkdir -p "$O"
run() { name=$1; shift; uptime > "$O/$name.load"; "$B/qpip-bench" "$@" > "$O/$name.txt" 2>&1; uptime >> "$O/$name.load"; }
run micro-lo micro --repeat 5
run micro-veth1500 micro --repeat 3 --netns --mtu 1500
run raw-lo nbd raw --repeat 5
run raw-veth1500 nbd raw --repeat 5 --netns --mtu 1500
run qd1-8s nbd qd1 --repeat 3
run qd1-3s-256M nbd qd1 --repeat 5 --runtime 3 --size 256M
