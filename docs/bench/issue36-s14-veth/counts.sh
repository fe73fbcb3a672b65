#!/bin/bash
# counts.sh OUT ROUNDS NAME=SERVER...: prof.sh rounds (4 x 1 GiB written, one connection, 256 KiB
# QD16) of several servers, interleaved, over veth MTU 1500 (namespace s14v, setup-netns.sh) and
# loopback (LINKS="veth lo" by default); sum.py OUT/veth OUT/lo gives the medians.
out=$1; rounds=$2; shift 2
export FIO_EVENTS="-e kmem:mm_page_alloc_zone_locked -e kmem:mm_page_free"
for r in $(seq 1 "$rounds"); do for link in ${LINKS:-veth lo}; do for spec in "$@"; do
  name=${spec%%=*}; n=""; [ $link = veth ] && n=1
  mkdir -p "$out"; uptime > "$out/load-$link-$name-$r.txt"
  NETNS=$n "$(dirname "$0")/prof.sh" "${spec#*=}" "$out/$link/$name-$r" write > /dev/null 2>&1
done; done; done
