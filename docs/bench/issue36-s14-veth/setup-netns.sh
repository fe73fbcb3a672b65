#!/bin/bash
# The namespace prof.sh uses with NETNS=1: s14v, veth pair s14v0/s14v1 of MTU ${1:-1500}.
ip netns add s14v
ip link add s14v0 mtu ${1:-1500} type veth peer name s14v1 mtu ${1:-1500} netns s14v
ip addr add 10.79.0.1/24 dev s14v0; ip link set s14v0 up
ip -n s14v addr add 10.79.0.2/24 dev s14v1; ip -n s14v link set s14v1 up; ip -n s14v link set lo up
