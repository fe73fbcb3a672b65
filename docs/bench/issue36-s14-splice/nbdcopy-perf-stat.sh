#!/bin/bash
# Setup (root), as in session 14: a 1 GiB random image on tmpfs and a veth pair at MTU 1500
# with its far end in netns s14:
#   dd if=/dev/urandom of=/dev/shm/s14img bs=1M count=1024
#   ip netns add s14; ip link add s14a type veth peer name s14b; ip link set s14b netns s14
#   ip addr add 10.99.0.1/24 dev s14a; ip link set s14a mtu 1500 up
#   ip -n s14 addr add 10.99.0.2/24 dev s14b; ip -n s14 link set s14b mtu 1500 up; ip -n s14 link set lo up
# Rounds: for r in 1 2 3 4; do for mode in veth loop; do for bin in OLD NEW; do ./nbdcopy-perf-stat.sh $bin $mode; done; done; done
# run1.sh BIN MODE(loop|veth) -> prints: MB/s server-task-clock-s/GB syscalls-per-read
BIN=$1; MODE=$2
if [ $MODE = veth ]; then NS="ip netns exec s14"; ADDR=10.99.0.2; else NS=""; ADDR=127.0.0.1; fi
$NS $BIN -b $ADDR -p 10898 -r /dev/shm/s14img > /tmp/s14/srv-$MODE.log 2>&1 &
for i in $(seq 50); do SP=$(ss -N s14 -ltnp 2>/dev/null | grep 10898 | grep -o 'pid=[0-9]*' | head -1 | cut -d= -f2); [ -z "$SP" ] && SP=$(ss -ltnp | grep 10898 | grep -o 'pid=[0-9]*' | head -1 | cut -d= -f2); [ -n "$SP" ] && break; sleep 0.1; done
nbdcopy --connections=1 --requests=16 --request-size=262144 nbd://$ADDR:10898 null: # warm
perf stat -e task-clock -e 'syscalls:sys_enter_splice,syscalls:sys_enter_write,syscalls:sys_enter_writev,syscalls:sys_enter_sendmsg,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_epoll_pwait,syscalls:sys_enter_readv,syscalls:sys_enter_read,syscalls:sys_enter_recvfrom,syscalls:sys_enter_futex,syscalls:sys_enter_ppoll,syscalls:sys_enter_mincore' -p $SP -o /tmp/s14/perf-$MODE.txt &
PP=$!; sleep 0.3
T0=$(date +%s.%N); for k in 1 2 3 4; do nbdcopy --connections=1 --requests=16 --request-size=262144 nbd://$ADDR:10898 null:; done; T1=$(date +%s.%N)
kill -INT $PP; wait $PP 2>/dev/null; kill $SP; wait $SP 2>/dev/null
python3 - $T0 $T1 /tmp/s14/perf-$MODE.txt <<'PY'
import sys,re
t0,t1,f=float(sys.argv[1]),float(sys.argv[2]),sys.argv[3]
gb=4*1.073741824; reads=4*4096
txt=open(f).read()
tc=float(re.search(r'([\d.,]+)\s+msec task-clock',txt).group(1).replace(',',''))/1000
sc={}
for m in re.finditer(r'([\d,]+)\s+syscalls:sys_enter_(\w+)',txt): sc[m.group(2)]=int(m.group(1).replace(',',''))
tot=sum(sc.values())
print(f"{gb*1000/(t1-t0):.0f} MB/s  server {tc/gb:.3f} s/GB  syscalls/read {tot/reads:.2f} "+" ".join(f"{k}={v/reads:.2f}" for k,v in sc.items() if v))
PY
