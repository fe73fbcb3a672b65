#!/bin/bash
# prof.sh SERVER(path to qpip-nbd-server | nbdkit) OUTDIR [write|read]: one connection, 256 KiB
# QD16, LOOPS x 1 GiB (default 4) of a prewritten image in $TMPDIR (ext4 /tmp here); perf stat per
# thread over the server and over fio, `ss -tim` of both ends every 50 ms, nstat in the server's
# namespace. With NETNS=1 the server runs in namespace s14v across a veth pair of MTU 1500
# (setup-netns.sh); BS: request size (256k); PERF_RECORD=1 adds `perf record -a -g` over the timed run (=server: of the server only).
set -e
srv=$1; out=$2; rw=${3:-write}; mkdir -p $out
img=${TMPDIR:-/tmp}/s14v-$$.raw; rm -f $img; truncate -s 1G $img
port=$((20000 + RANDOM % 20000))
host=127.0.0.1; NX=""
if [ -n "$NETNS" ]; then host=10.79.0.2; NX="ip netns exec s14v"; fi
if [ "$srv" = nbdkit ]; then
  $NX nbdkit --foreground --exit-with-parent -i $host -p $port -e bench file file=$img & sleep 0.3
else
  $NX $srv --listen $host:$port --log warn --export bench=$img 2>$out/server.log & sleep 0.3
fi
spid=$(pgrep -n -f -- "$port")
sleep 0.5
uri=nbd://$host:$port/bench
fio --name=pre --ioengine=nbd --uri=$uri --rw=write --bs=${BS:-256k} --iodepth=16 --size=1G --output-format=terse >/dev/null
$NX nstat -n >/dev/null 2>&1 || true
perf stat -x, --per-thread -p $spid -e task-clock,context-switches,'syscalls:sys_enter_splice','syscalls:sys_enter_epoll_wait','syscalls:sys_enter_readv','syscalls:sys_enter_read','syscalls:sys_enter_writev','syscalls:sys_enter_ppoll','syscalls:sys_enter_recvfrom','syscalls:sys_enter_pwrite64','syscalls:sys_enter_futex','syscalls:sys_enter_sendmsg','syscalls:sys_enter_sendto','syscalls:sys_enter_setsockopt','syscalls:sys_enter_vmsplice' -o $out/srv-stat.txt &
ppid=$!
( while :; do echo "== $(date +%s.%N)"; $NX ss -tinm "sport = :$port"; ss -tinm "dport = :$port"; sleep 0.05; done ) > $out/ss.txt 2>&1 &
sspid=$!
if [ -n "$PERF_RECORD" ]; then target=-a; [ "$PERF_RECORD" = server ] && target="-p $spid"; perf record $target -g -o $out/perf.data 2>$out/perf-record.log & rpid=$!; fi
sleep 0.2
perf stat -x, -e task-clock,context-switches,'syscalls:sys_enter_sendto','syscalls:sys_enter_sendmsg','syscalls:sys_enter_recvfrom','syscalls:sys_enter_poll','syscalls:sys_enter_ppoll' ${FIO_EVENTS} -o $out/fio-stat.txt \
 fio --name=t --ioengine=nbd --uri=$uri --rw=$rw --bs=${BS:-256k} --iodepth=16 --size=1G --loops=${LOOPS:-4} --output-format=json > $out/fio.json
[ -n "$PERF_RECORD" ] && { kill -INT $rpid; wait $rpid 2>/dev/null || true; }
kill $sspid; wait $sspid 2>/dev/null || true
kill -INT $ppid; wait $ppid 2>/dev/null || true
$NX nstat > $out/nstat.txt 2>&1 || true
kill $spid; wait $spid 2>/dev/null || true
rm -f $img
python3 - $out/fio.json $rw <<'PY'
import json,sys
t=open(sys.argv[1]).read(); j=json.loads(t[t.index("{"):])['jobs'][0][sys.argv[2]]
print("MB/s", j['bw_bytes']/1e6)
PY
