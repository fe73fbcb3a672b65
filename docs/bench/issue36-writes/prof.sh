#!/bin/bash
# prof.sh SERVER(qpip-bin|nbdkit) OUTDIR [read|write]: one connection, 256 KiB QD16, LOOPS x 1 GiB
# (default 1) of a prewritten image in $TMPDIR (ext4 /tmp here); perf stat per thread over the
# server and over fio. With NETNS=1 the server runs in namespace "wtw" across a veth pair of
# MTU 1500, made beforehand with:
#   ip netns add wtw; ip link add wtw0 mtu 1500 type veth peer name wtw1 mtu 1500 netns wtw
#   ip addr add 10.78.0.1/24 dev wtw0; ip link set wtw0 up
#   ip -n wtw addr add 10.78.0.2/24 dev wtw1; ip -n wtw link set wtw1 up; ip -n wtw link set lo up
set -e
srv=$1; out=$2; rw=${3:-write}; mkdir -p $out
img=${TMPDIR:-/tmp}/issue36-writes.raw; rm -f $img; truncate -s 1G $img
port=$((20000 + RANDOM % 20000))
host=127.0.0.1; NX=""
if [ -n "$NETNS" ]; then host=10.78.0.2; NX="ip netns exec wtw"; fi
if [ "$srv" = nbdkit ]; then
  $NX nbdkit --foreground --exit-with-parent -i $host -p $port -e bench file file=$img & spid=$!; sleep 0.3; spid=$(pgrep -n -f "$port")
else
  $NX $srv --listen $host:$port --log warn --export bench=$img 2>$out/server.log & spid=$!; sleep 0.3; spid=$(pgrep -n -f "$port")
fi
sleep 0.5
uri=nbd://$host:$port/bench
fio --name=pre --ioengine=nbd --uri=$uri --rw=write --bs=256k --iodepth=16 --size=1G --output-format=terse >/dev/null
if [ "$rw" = read ]; then frw=read; else frw=write; fi
$NX nstat -n >/dev/null 2>&1 || true
perf stat -x, --per-thread -p $spid -e task-clock,context-switches,'syscalls:sys_enter_splice','syscalls:sys_enter_epoll_wait','syscalls:sys_enter_readv','syscalls:sys_enter_read','syscalls:sys_enter_writev','syscalls:sys_enter_ppoll','syscalls:sys_enter_recvfrom','syscalls:sys_enter_pwrite64','syscalls:sys_enter_futex','syscalls:sys_enter_sendmsg','syscalls:sys_enter_sendto','syscalls:sys_enter_pread64','syscalls:sys_enter_setsockopt' -o $out/srv-stat.txt &
ppid=$!
sleep 0.2
perf stat -x, -e task-clock,context-switches,'syscalls:sys_enter_sendto','syscalls:sys_enter_recvfrom','syscalls:sys_enter_poll','syscalls:sys_enter_ppoll' -o $out/fio-stat.txt \
 fio --name=t --ioengine=nbd --uri=$uri --rw=$frw --bs=256k --iodepth=16 --size=1G --loops=${LOOPS:-1} --output-format=json > $out/fio.json
kill -INT $ppid; wait $ppid 2>/dev/null || true
$NX nstat TcpOutSegs TcpInSegs TcpExtTCPHPAcks TcpExtTCPPureAcks TcpExtDelayedACKs> $out/nstat.txt 2>&1 || true
kill $spid; wait $spid 2>/dev/null || true
rm -f $img
python3 - $out/fio.json $frw <<'PY'
import json,sys
t=open(sys.argv[1]).read(); j=json.loads(t[t.index("{"):])['jobs'][0][sys.argv[2]]
print("MB/s", j['bw_bytes']/1e6)
PY
