"""Hosts on one machine, each in a network namespace of its own, and the network faults
between them: partitions, lost packets, a bandwidth cap.

A `Network` is a Linux bridge in this (the root) network namespace and N hosts. Each
host is a namespace with loopback up and a veth pair to the bridge, and an address in
a private /24 the run picks: 10.123.X.0/24, with X such that nothing on this machine
routes or holds an address there yet. This namespace takes the /24's first address on
the bridge, so a process here (a test's client) reaches every host. A program runs on
a host through `ip netns exec NAME` (`Host.launch_prefix`), which execs it: its PID is
the program's own, so signals reach it.

Faults are nftables rules in each host's own namespace — never in this one, and never
aimed at an address the network did not make:

- `cut(a, b)` / `heal(a, b)`: packets between two hosts are dropped, both ways. Each
  host has a set of blocked peers; its rules drop what comes from and goes to them.
  Dropped, not rejected: a connection hangs as when a cable is pulled, and a program
  learns of it only through its own timeouts.
- `isolate(host)` / `rejoin(host)`: the host blocks every other address of the network,
  this namespace's included.
- `lossy(host, percent)`: each packet entering or leaving the host's link is dropped
  with that probability (`numgen random mod 100`).
- `bandwidth(host, bytes_per_s)`: what goes over that rate, each way, is dropped
  (`limit rate over`): a policer, so TCP backs off and the link is slow in throughput.
  It adds no latency. A true delay needs the netem qdisc, which this machine's kernel
  lacks (as it lacks tbf); this is the closest it allows, and it is no more than that.
  Netfilter sees the veth's GSO packets (up to 64 KiB each) before segmentation, so a
  loss drops a burst of segments at once under bulk transfer, and the policer's burst
  is at least 128 KiB so that one such packet can pass.
- `heal_all()`.

Which pairs are cut, which hosts isolated, and each host's loss and rate are kept
here; a change rewrites the affected hosts' set or chains in one atomic `nft -f`.

Everything is named after one prefix per run (`sl` and 6 hex digits: the bridge
`<prefix>br`, the veths `<prefix>v<i>`, the namespaces `<prefix>-<host>`, the nft table
`<prefix>` in each), so `teardown` removes exactly what this run made; a namespace
takes its nft table with it. The commands and nft scripts are built by pure functions
(tested without root); `Network` runs them. It needs root, `ip` (iproute2) and `nft`
(nftables); `unavailable()` says why it cannot run, or None.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import random
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

SUPERNET = "10.123"  # the run's /24 is 10.123.X.0/24
GATEWAY_INDEX = 1  # this namespace's address on the bridge
FIRST_HOST_INDEX = 10
MAX_HOSTS = 200
HOST_LINK = "eth0"  # the host's end of its veth
MIN_BURST_BYTES = 131072  # two GSO packets (see the module's docstring)
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")


class NetnsError(RuntimeError):
    """A namespace, link or nft rule could not be made (or removed); says which."""


@dataclass(frozen=True, slots=True)
class Host:
    name: str
    netns: str
    address: str
    veth: str  # its end on the bridge, in this namespace

    @property
    def launch_prefix(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.netns)


@dataclass(frozen=True, slots=True)
class Plan:
    """A network's names and addresses, before anything exists."""

    prefix: str
    subnet: ipaddress.IPv4Network
    hosts: tuple[Host, ...]

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    @property
    def gateway(self) -> str:
        return str(self.subnet[GATEWAY_INDEX])

    @property
    def table(self) -> str:
        return self.prefix


class Command(NamedTuple):
    argv: tuple[str, ...]
    stdin: str | None = None


def new_prefix() -> str:
    return "sl" + secrets.token_hex(3)


def make_plan(names: Sequence[str], subnet: ipaddress.IPv4Network, prefix: str) -> Plan:
    if not re.fullmatch(r"[a-z][a-z0-9]{1,9}", prefix):
        raise NetnsError(f"prefix {prefix!r}: 2-10 lowercase letters and digits")
    if not 1 <= len(names) <= MAX_HOSTS or len(set(names)) != len(names):
        raise NetnsError(f"1 to {MAX_HOSTS} distinct host names, not {list(names)}")
    bad = [name for name in names if not _NAME.match(name)]
    if bad:
        raise NetnsError(f"host names are lowercase letters, digits and '-': {bad}")
    if subnet.prefixlen != 24:
        raise NetnsError(f"a /24 is needed, not {subnet}")
    return Plan(prefix, subnet, tuple(
        Host(name, f"{prefix}-{name}", str(subnet[FIRST_HOST_INDEX + i]), f"{prefix}v{i}")
        for i, name in enumerate(names)))


def used_networks(routes: str, addresses: str) -> list[ipaddress.IPv4Network]:
    """The networks of `ip -4 route show` and `ip -4 -o addr show` (a default route is
    no claim on an address range)."""
    found = []
    for line in routes.splitlines():
        words = line.split()
        if words and words[0] != "default":
            with contextlib.suppress(ValueError):
                found.append(ipaddress.IPv4Network(words[0], strict=False))
    for line in addresses.splitlines():
        words = line.split()
        if "inet" in words:
            with contextlib.suppress(ValueError, IndexError):
                found.append(ipaddress.IPv4Network(words[words.index("inet") + 1],
                                                   strict=False))
    return found


def pick_subnet(used: Iterable[ipaddress.IPv4Network],
                rng: random.Random) -> ipaddress.IPv4Network:
    taken = list(used)
    free = [net for net in (ipaddress.IPv4Network(f"{SUPERNET}.{x}.0/24") for x in range(256))
            if not any(net.overlaps(other) for other in taken)]
    if not free:
        raise NetnsError(f"every /24 of {SUPERNET}.0.0/16 is routed on this machine already")
    return rng.choice(free)


def setup_commands(plan: Plan) -> list[Command]:
    bits = str(plan.subnet.prefixlen)
    cmds = [Command(("ip", "link", "add", plan.bridge, "type", "bridge")),
            Command(("ip", "addr", "add", f"{plan.gateway}/{bits}", "dev", plan.bridge)),
            Command(("ip", "link", "set", plan.bridge, "up"))]
    for host in plan.hosts:
        ns = host.netns
        cmds += [
            Command(("ip", "netns", "add", ns)),
            Command(("ip", "link", "add", host.veth, "type", "veth", "peer", "name", HOST_LINK,
                     "netns", ns)),
            Command(("ip", "link", "set", host.veth, "master", plan.bridge, "up")),
            Command(("ip", "-n", ns, "addr", "add", f"{host.address}/{bits}", "dev", HOST_LINK)),
            Command(("ip", "-n", ns, "link", "set", HOST_LINK, "up")),
            Command(("ip", "-n", ns, "link", "set", "lo", "up")),
            Command((*host.launch_prefix, "nft", "-f", "-"), nft_base(plan.table)),
        ]
    return cmds


def teardown_commands(plan: Plan) -> list[Command]:
    """Deleting a veth deletes its pair; deleting a namespace, its nft table."""
    return ([Command(("ip", "link", "del", host.veth)) for host in plan.hosts]
            + [Command(("ip", "netns", "del", host.netns)) for host in plan.hosts]
            + [Command(("ip", "link", "del", plan.bridge))])


def nft_base(table: str) -> str:
    """The host's table: a set of blocked peers, and two shaping chains after it."""
    return (f"table inet {table} {{\n"
            "  set blocked { type ipv4_addr; }\n"
            "  chain input { type filter hook input priority 0; policy accept; "
            "ip saddr @blocked drop; }\n"
            "  chain output { type filter hook output priority 0; policy accept; "
            "ip daddr @blocked drop; }\n"
            "  chain shape_in { type filter hook input priority 10; policy accept; }\n"
            "  chain shape_out { type filter hook output priority 10; policy accept; }\n"
            "}\n")


def nft_blocked(table: str, addresses: Iterable[str]) -> str:
    lines = [f"flush set inet {table} blocked"]
    wanted = sorted(addresses, key=ipaddress.IPv4Address)
    if wanted:
        lines.append(f"add element inet {table} blocked {{ {', '.join(wanted)} }}")
    return "\n".join(lines) + "\n"


def nft_shaping(table: str, loss_percent: int = 0, bytes_per_s: int | None = None) -> str:
    if not 0 <= loss_percent <= 100:
        raise NetnsError(f"a loss of {loss_percent} %: 0 to 100")
    if bytes_per_s is not None and bytes_per_s < 1:
        raise NetnsError(f"a rate of {bytes_per_s} bytes/s: at least 1")
    lines = [f"flush chain inet {table} shape_in", f"flush chain inet {table} shape_out"]
    for chain, link in (("shape_in", "iifname"), ("shape_out", "oifname")):
        rule = f'add rule inet {table} {chain} {link} != "lo"'
        if loss_percent == 100:
            lines.append(f"{rule} drop")
        elif loss_percent:
            lines.append(f"{rule} numgen random mod 100 < {loss_percent} drop")
        if bytes_per_s is not None:
            burst = max(bytes_per_s, MIN_BURST_BYTES)
            lines.append(f"{rule} limit rate over {bytes_per_s} bytes/second "
                         f"burst {burst} bytes drop")
    return "\n".join(lines) + "\n"


def blocked_peers(plan: Plan, cuts: Iterable[frozenset[str]],
                  isolated: Iterable[str]) -> dict[str, set[str]]:
    """Host name -> the addresses it must drop packets from and to."""
    address = {host.name: host.address for host in plan.hosts}
    out: dict[str, set[str]] = {name: set() for name in address}
    for pair in cuts:
        a, b = sorted(pair)
        out[a].add(address[b])
        out[b].add(address[a])
    for name in isolated:
        out[name] |= {plan.gateway, *(a for n, a in address.items() if n != name)}
    return out


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, a tool missing, the kernel refusing
    a namespace or an nft table in it), or None."""
    if os.geteuid() != 0:
        return f"network namespaces need root (this process runs as uid {os.geteuid()})"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: apt-get install -y {package})"
    probe = f"{new_prefix()}-probe"
    try:
        for cmd in (Command(("ip", "netns", "add", probe)),
                    Command(("ip", "netns", "exec", probe, "nft", "-f", "-"), nft_base("probe"))):
            done = _run(cmd, check=False)
            if done.returncode != 0:
                return f"`{' '.join(cmd.argv)}` failed: {done.stderr.strip()}"
    finally:
        _run(Command(("ip", "netns", "del", probe)), check=False)
    return None


def leftovers(prefix: str) -> list[str]:
    """The namespaces and links named after `prefix` that exist (after `teardown`: none)."""
    spaces = _run(Command(("ip", "netns", "list")), check=False).stdout.split("\n")
    links = _run(Command(("ip", "-o", "link", "show")), check=False).stdout.split("\n")
    names = [line.split()[0] for line in spaces if line.strip()]
    names += [line.split()[1].split("@")[0].rstrip(":") for line in links if line.strip()]
    return [name for name in names if name.startswith(prefix)]


@dataclass(slots=True)
class Network:
    """A bridge and its hosts, as made by `create`; the faults between them."""

    plan: Plan
    _cuts: set[frozenset[str]] = field(default_factory=set)
    _isolated: set[str] = field(default_factory=set)
    _loss: dict[str, int] = field(default_factory=dict)
    _rate: dict[str, int] = field(default_factory=dict)

    @classmethod
    def create(cls, names: Sequence[str], prefix: str | None = None) -> Network:
        reason = unavailable()
        if reason is not None:
            raise NetnsError(reason)
        # Two runs must not pick the same /24 between looking and taking it.
        with _lock():
            used = used_networks(_run(Command(("ip", "-4", "route", "show"))).stdout,
                                 _run(Command(("ip", "-4", "-o", "addr", "show"))).stdout)
            net = cls(make_plan(names, pick_subnet(used, random.Random()),
                                prefix or new_prefix()))
            try:
                for cmd in setup_commands(net.plan):
                    _run(cmd)
            except BaseException as exc:
                try:
                    net.teardown()
                except NetnsError as left:
                    exc.add_note(str(left))
                raise
        return net

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.teardown()

    @property
    def gateway(self) -> str:
        """This namespace's address on the bridge."""
        return self.plan.gateway

    def host(self, name: str) -> Host:
        for host in self.plan.hosts:
            if host.name == name:
                return host
        raise NetnsError(f"no host {name!r} in {[h.name for h in self.plan.hosts]}")

    def run_in(self, name: str, argv: Sequence[str], *, timeout: float | None = None,
               check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run `argv` on a host, wait for it, return what it printed."""
        return _run(Command((*self.host(name).launch_prefix, *argv), stdin), check=check,
                    timeout=timeout)

    def cut(self, a: str, b: str) -> None:
        self._set_blocked(lambda: self._cuts.add(self._pair(a, b)))

    def heal(self, a: str, b: str) -> None:
        self._set_blocked(lambda: self._cuts.discard(self._pair(a, b)))

    def isolate(self, name: str) -> None:
        self._set_blocked(lambda: self._isolated.add(self.host(name).name))

    def rejoin(self, name: str) -> None:
        self._set_blocked(lambda: self._isolated.discard(self.host(name).name))

    def lossy(self, name: str, percent: int) -> None:
        """Drop `percent` % of the host's packets, each way (0: none)."""
        self._loss[self.host(name).name] = percent
        self._shape(name)

    def bandwidth(self, name: str, bytes_per_s: int | None) -> None:
        """Cap the host's link at `bytes_per_s` each way (None: no cap); see the module's
        docstring for what this is and is not."""
        if bytes_per_s is None:
            self._rate.pop(self.host(name).name, None)
        else:
            self._rate[self.host(name).name] = bytes_per_s
        self._shape(name)

    def heal_all(self) -> None:
        shaped = set(self._loss) | set(self._rate)
        self._loss.clear()
        self._rate.clear()
        for name in shaped:
            self._shape(name)
        self._set_blocked(lambda: (self._cuts.clear(), self._isolated.clear()))

    def teardown(self) -> None:
        """Remove the veths, the namespaces and the bridge this network made (the
        programs on its hosts are the caller's to stop first); raises if any is left."""
        for cmd in teardown_commands(self.plan):
            _run(cmd, check=False)
        left = leftovers(self.plan.prefix)
        if left:
            raise NetnsError(f"left after teardown: {left}")

    def _pair(self, a: str, b: str) -> frozenset[str]:
        if self.host(a).name == self.host(b).name:
            raise NetnsError(f"a host cannot be cut from itself ({a})")
        return frozenset((a, b))

    def _set_blocked(self, change: Callable[[], object]) -> None:
        before = blocked_peers(self.plan, self._cuts, self._isolated)
        change()
        after = blocked_peers(self.plan, self._cuts, self._isolated)
        for name, peers in after.items():
            if peers != before[name]:
                self.run_in(name, ("nft", "-f", "-"), stdin=nft_blocked(self.plan.table, peers))

    def _shape(self, name: str) -> None:
        script = nft_shaping(self.plan.table, self._loss.get(name, 0), self._rate.get(name))
        self.run_in(name, ("nft", "-f", "-"), stdin=script)


def _run(cmd: Command, check: bool = True,
         timeout: float | None = 30.0) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd.argv, input=cmd.stdin, capture_output=True, text=True,
                          check=False, timeout=timeout)
    if check and done.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd.argv)}` failed ({done.returncode}): "
                         f"{(done.stderr or done.stdout).strip()}")
    return done


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    path = Path(tempfile.gettempdir()) / "sluice-netns.lock"
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
