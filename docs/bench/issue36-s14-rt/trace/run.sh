#!/bin/bash
# The spinning TCP round trip's syscalls with timestamps (tracepoints inflate each call by
# a few hundred ns): per thread, how long a look takes, how long from the read that returns
# the byte to the send that answers it. 20 000 round trips (22 000 with the warm-up).
BIN=${BIN:-target/release/qpip-bench}
perf record -e 'syscalls:sys_enter_readv,syscalls:sys_exit_readv,syscalls:sys_enter_writev,syscalls:sys_exit_writev' \
  -o /tmp/trace.data $BIN micro --only qp-tcp --count 20000 --repeat 1
perf script -i /tmp/trace.data -F tid,time,event,trace --ns > /tmp/trace.txt
python3 "$(dirname "$0")/trace.py" /tmp/trace.txt
# The busy-polling socket row the same way (same tracing cost per call):
perf record -e 'syscalls:sys_enter_recvfrom,syscalls:sys_exit_recvfrom,syscalls:sys_enter_sendto,syscalls:sys_exit_sendto' \
  -o /tmp/trace-sock.data $BIN micro --only socket-tcp --count 20000 --repeat 1
perf script -i /tmp/trace-sock.data -F tid,time,event,trace --ns > /tmp/trace-sock.txt
python3 "$(dirname "$0")/trace.py" /tmp/trace-sock.txt
