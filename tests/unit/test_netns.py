"""`infra.netns`: the commands and nft scripts exactly (no root needed), then, where this
process may make namespaces, two real hosts: TCP between them, cut, healed, torn down."""

from __future__ import annotations

import ipaddress
import random
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from infra import netns
from infra.netns import Command, NetnsError, Network

SUBNET = ipaddress.IPv4Network("10.123.7.0/24")


def test_a_plan_names_everything_after_its_prefix() -> None:
    plan = netns.make_plan(["kafka1", "worker0"], SUBNET, "slabc123")
    assert plan.bridge == "slabc123br" and plan.gateway == "10.123.7.1"
    assert [(h.name, h.netns, h.address, h.veth) for h in plan.hosts] == [
        ("kafka1", "slabc123-kafka1", "10.123.7.10", "slabc123v0"),
        ("worker0", "slabc123-worker0", "10.123.7.11", "slabc123v1")]
    assert plan.hosts[0].launch_prefix == ("ip", "netns", "exec", "slabc123-kafka1")


@pytest.mark.parametrize(("names", "prefix", "subnet"), [
    (["a", "a"], "slabc123", SUBNET), (["Bad_Name"], "slabc123", SUBNET),
    (["a"], "sl-abc", SUBNET), (["a"], "slabc123", ipaddress.IPv4Network("10.123.0.0/16")),
    ([], "slabc123", SUBNET)])
def test_a_plan_refuses_names_an_interface_or_namespace_cannot_have(
        names: list[str], prefix: str, subnet: ipaddress.IPv4Network) -> None:
    with pytest.raises(NetnsError):
        netns.make_plan(names, subnet, prefix)


def test_the_subnet_is_one_nothing_here_routes_or_holds() -> None:
    routes = ("default via 192.0.2.1 dev eth0\n"
              "192.0.2.0/24 dev eth0 proto kernel scope link src 192.0.2.2\n"
              "10.123.0.0/17 via 192.0.2.9 dev eth0\n")
    addresses = "2: eth0    inet 192.0.2.2/24 brd 192.0.2.255 scope global eth0\n" \
                "9: br9    inet 10.123.200.1/24 scope global br9\n"
    used = netns.used_networks(routes, addresses)
    assert ipaddress.IPv4Network("0.0.0.0/0") not in used  # a default route claims nothing
    rng = random.Random(3)
    picks = {netns.pick_subnet(used, rng) for _ in range(300)}
    free = {ipaddress.IPv4Network(f"10.123.{x}.0/24") for x in range(128, 256) if x != 200}
    assert picks <= free and len(picks) > 60
    with pytest.raises(NetnsError, match="routed on this machine"):
        netns.pick_subnet([ipaddress.IPv4Network("10.0.0.0/8")], rng)


def test_setup_makes_the_bridge_then_each_host_and_teardown_removes_them() -> None:
    plan = netns.make_plan(["h0"], SUBNET, "slabc123")
    setup = netns.setup_commands(plan)
    assert [c.argv for c in setup[:3]] == [
        ("ip", "link", "add", "slabc123br", "type", "bridge"),
        ("ip", "addr", "add", "10.123.7.1/24", "dev", "slabc123br"),
        ("ip", "link", "set", "slabc123br", "up")]
    assert setup[4].argv == ("ip", "link", "add", "slabc123v0", "type", "veth", "peer", "name",
                             "eth0", "netns", "slabc123-h0")
    assert setup[-1] == Command(("ip", "netns", "exec", "slabc123-h0", "nft", "-f", "-"),
                                netns.nft_base("slabc123"))
    assert [c.argv for c in netns.teardown_commands(plan)] == [
        ("ip", "link", "del", "slabc123v0"), ("ip", "netns", "del", "slabc123-h0"),
        ("ip", "link", "del", "slabc123br")]


def test_the_nft_scripts_drop_blocked_peers_and_shape_only_the_link() -> None:
    assert "ip saddr @blocked drop" in netns.nft_base("t")
    assert netns.nft_blocked("t", ["10.123.7.11", "10.123.7.2"]) == (
        "flush set inet t blocked\nadd element inet t blocked { 10.123.7.2, 10.123.7.11 }\n")
    assert netns.nft_blocked("t", []) == "flush set inet t blocked\n"
    assert netns.nft_shaping("t", 7, 50_000).splitlines() == [
        "flush chain inet t shape_in", "flush chain inet t shape_out",
        'add rule inet t shape_in iifname != "lo" numgen random mod 100 < 7 drop',
        'add rule inet t shape_in iifname != "lo" limit rate over 50000 bytes/second '
        "burst 131072 bytes drop",
        'add rule inet t shape_out oifname != "lo" numgen random mod 100 < 7 drop',
        'add rule inet t shape_out oifname != "lo" limit rate over 50000 bytes/second '
        "burst 131072 bytes drop"]
    assert netns.nft_shaping("t").count("add rule") == 0
    assert 'iifname != "lo" drop' in netns.nft_shaping("t", 100)
    for loss, rate in ((101, None), (-1, None), (0, 0)):
        with pytest.raises(NetnsError):
            netns.nft_shaping("t", loss, rate)


def test_cuts_block_both_ends_and_isolation_blocks_everyone_else() -> None:
    plan = netns.make_plan(["a", "b", "c"], SUBNET, "slabc123")
    assert netns.blocked_peers(plan, [frozenset(("a", "b"))], []) == {
        "a": {"10.123.7.11"}, "b": {"10.123.7.10"}, "c": set()}
    assert netns.blocked_peers(plan, [], ["c"]) == {
        "a": set(), "b": set(), "c": {"10.123.7.1", "10.123.7.10", "10.123.7.11"}}


@pytest.fixture
def two_hosts() -> Iterator[Network]:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"no network namespaces here: {reason}")
    net = Network.create(["a", "b"])
    try:
        yield net
    finally:
        net.teardown()
        assert netns.leftovers(net.plan.prefix) == []


SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 7070))
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(b"hi")
    c.close()
"""
CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], 7070), timeout=1.5) as c:
        sys.exit(0 if c.recv(2) == b"hi" else 2)
except OSError:
    sys.exit(1)
"""


def test_a_cut_stops_tcp_between_two_hosts_and_heal_restores_it(two_hosts: Network) -> None:
    net = two_hosts
    b = net.host("b").address
    server = subprocess.Popen([*net.host("b").launch_prefix, sys.executable, "-c", SERVER, b],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "listening\n"

        def reaches() -> bool:
            return net.run_in("a", [sys.executable, "-c", CLIENT, b], check=False).returncode == 0

        assert reaches()
        net.cut("a", "b")
        began = time.monotonic()
        assert not reaches() and time.monotonic() - began >= 1.0  # dropped: it hangs
        net.heal("a", "b")
        assert reaches()
        net.isolate("b")
        assert not reaches()
        net.heal_all()
        net.lossy("a", 100)
        assert not reaches()
        net.lossy("a", 0)
        net.bandwidth("a", 100_000)
        assert reaches()
    finally:
        server.kill()
        server.wait()
