#!/bin/bash
# probe.sh SERVER OUT: prof.sh over veth (one 1 GiB write pass) with `perf record -e tcp:tcp_probe -a`:
# which thread ran each TCP receive of the server's socket (data) and of fio's (ACKs, replies).
srv=$1; out=$2; mkdir -p $out
( sleep 1.2; perf record -e tcp:tcp_probe -a -o $out/probe.data sleep 1.5 2>$out/probe.log ) &
LOOPS=4 NETNS=1 "$(dirname "$0")/prof.sh" $srv $out write
wait
perf script -i $out/probe.data -F comm,trace 2>/dev/null | awk '{c=$1; for(i=2;i<=NF;i++){if($i ~ /^src=/) s=$i; if($i ~ /^data_len=/) d=substr($i,10)}; side=(s ~ /10\.79\.0\.2/)?"server-sock":"fio-sock"; k=c" "side; n[k]++; b[k]+=d} END{for(k in n) printf "%-40s %8d skbs %10.1f MB\n", k, n[k], b[k]/1e6}' | sort > $out/probe.txt
cat $out/probe.txt
