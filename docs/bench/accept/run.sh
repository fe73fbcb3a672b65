#!/bin/sh
# The connect-and-reset flood and the greetings (issue 34 M1), old and new qpip-nbd-server
# interleaved with nbdkit and qemu-nbd, ROUNDS rounds, one server at a time:
#   docs/bench/accept/run.sh OLD_SERVER NEW_SERVER [ROUNDS]
# Release builds of qpip-nbd-server only (cargo build -p nbd-server --release --bin qpip-nbd-server).
set -u
old=$1 new=$2 rounds=${3:-3}
dir=$(dirname "$0")/..
img=$(mktemp) && truncate -s 64M "$img"
port=20900
for r in $(seq 1 "$rounds"); do
    for s in old new nbdkit qemu-nbd; do
        port=$((port + 1))
        case $s in
            old) "$old" -l 127.0.0.1:$port >/dev/null 2>&1 & ;;
            new) "$new" -l 127.0.0.1:$port >/dev/null 2>&1 & ;;
            nbdkit) nbdkit -f -i 127.0.0.1 -p $port memory 64M >/dev/null 2>&1 & ;;
            qemu-nbd) qemu-nbd -t -e 64 -b 127.0.0.1 -p $port -f raw "$img" >/dev/null 2>&1 & ;;
        esac
        pid=$!
        sleep 1
        echo "round $r $s ($(uptime | sed 's/.*load/load/'))"
        python3 "$dir/flood.py" $port 5000
        python3 "$dir/greet.py" $port 2000
        kill $pid; wait $pid 2>/dev/null
    done
done
rm -f "$img"
