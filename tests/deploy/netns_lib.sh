# Sourced by the deploy tests that give each daemon a host of its own on one machine: network
# namespaces joined by veth pairs to a bridge in a hub namespace. Traffic never leaves the
# machine, and each namespace has its own loopback.

# netns_bridge NET HUB NS...: HUB (already created by the caller, whose `ip netns add` doubles as
# the can-we-run check) gets the bridge br0 at NET.1/24; each NS is created and gets eth0 at
# NET.2, NET.3, ... in the order given. Loopback is brought up everywhere.
netns_bridge() {
  local net="$1" hub="$2"
  shift 2
  local ns n=2
  for ns in "$@"; do ip netns add "$ns"; done
  ip -n "$hub" link add br0 type bridge
  ip -n "$hub" link set br0 up
  ip -n "$hub" addr add "$net.1/24" dev br0
  for ns in "$@"; do
    # One veth pair per namespace: eth0 inside it, the other end on the hub's bridge.
    ip link add "${ns}0" type veth peer name "${ns}1"
    ip link set "${ns}0" netns "$ns"
    ip link set "${ns}1" netns "$hub"
    ip -n "$ns" link set "${ns}0" name eth0
    ip -n "$ns" addr add "$net.$n/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$hub" link set "${ns}1" master br0 up
    n=$((n + 1))
  done
  for ns in "$hub" "$@"; do ip -n "$ns" link set lo up; done
}
