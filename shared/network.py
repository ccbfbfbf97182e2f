"""Start-up check of a multi-node job's network, before the first gloo collective can hang.

    check_gloo_network()        # under torchrun, before init_process_group / the first gloo group

Gloo binds each rank to the address its hostname resolves to (torch's ProcessGroupGloo default
device) unless GLOO_SOCKET_IFNAME names an interface. Where the hostname resolves to loopback (the
127.0.1.1 line Debian and Ubuntu images write into /etc/hosts), every rank binds to 127.x and
advertises it: ranks on one node still meet, ranks on other nodes never reach it and the first
collective waits until its timeout (10 minutes for stage 1's join). Stage 1's process group and
barriers and stage 2's checkpoint agreement group are gloo, so both stages call this first.

A rendezvous on loopback (MASTER_ADDR 127.0.0.1: several "nodes" on one machine) needs nothing.
Otherwise a job spans nodes when WORLD_SIZE > LOCAL_WORLD_SIZE (torchrun and accelerate launch set
both): refused, naming the fix. Without LOCAL_WORLD_SIZE (another launcher), when MASTER_ADDR is
not an address of this machine: refused; when it is, other ranks may still be elsewhere: a warning.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Mapping

from shared.errors import ConfigError

log = logging.getLogger(__name__)


def _addresses(host: str) -> list[str]:
    """What `host` resolves to (empty when it does not: gloo then falls back to loopback too)."""
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
    except (socket.gaierror, UnicodeError):
        return []


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def _is_local(address: str) -> bool:
    """Whether `address` belongs to this machine (it can be bound here)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False


def _interfaces() -> dict[str, str]:
    """This machine's interfaces with an IPv4 address: name -> address (Linux; empty elsewhere)."""
    try:
        import fcntl
        import struct

        found = {}
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            for _, name in socket.if_nameindex():
                try:  # SIOCGIFADDR
                    packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                except OSError:  # no IPv4 address
                    continue
                address = socket.inet_ntoa(packed[20:24])
                if not _is_loopback(address):
                    found[name] = address
        return found
    except (OSError, ImportError):
        return {}


def _route_to(address: str) -> str | None:
    """The local address this machine reaches `address` from (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            return probe.getsockname()[0]
    except OSError:
        return None


def _suggest(master: list[str]) -> str:
    """The GLOO_SOCKET_IFNAME to set: the interface toward MASTER_ADDR, else those with an address."""
    interfaces = _interfaces()
    local = next((a for a in map(_route_to, master) if a), None)
    toward = next((name for name, address in interfaces.items() if address == local), None)
    if toward is not None:
        return f"`export GLOO_SOCKET_IFNAME={toward}` (the interface this node reaches MASTER_ADDR through, {local})"
    listed = ", ".join(f"{name} {address}" for name, address in interfaces.items()) or "none found"
    return f"`export GLOO_SOCKET_IFNAME=<interface>` (interfaces here: {listed})"


def gloo_network_problem(env: Mapping[str, str] | None = None) -> tuple[str, bool] | None:
    """(what is wrong and its fix, whether the job surely spans nodes), or None when gloo will bind
    to an address other nodes can reach (or the job is on one node, or GLOO_SOCKET_IFNAME is set)."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    if world <= 1 or env.get("GLOO_SOCKET_IFNAME"):
        return None
    host = socket.gethostname()
    resolved = _addresses(host)
    if resolved and not all(_is_loopback(a) for a in resolved):
        return None
    master_addr = env.get("MASTER_ADDR", "127.0.0.1")
    master = _addresses(master_addr)
    if not master or all(_is_loopback(a) for a in master):
        return None  # a rendezvous on loopback: every rank is on this machine
    if env.get("LOCAL_WORLD_SIZE"):
        local_world = int(env["LOCAL_WORLD_SIZE"])
        if local_world >= world:
            return None
        spans = f"WORLD_SIZE={world} > LOCAL_WORLD_SIZE={local_world}: this job spans nodes"
        certain = True
    else:
        certain = not any(_is_local(a) for a in master)
        where = "another machine" if certain else "this machine, and other ranks may be on other nodes"
        spans = f"MASTER_ADDR={master_addr} is {where}"
    return (
        f"this node's hostname {host!r} resolves to {', '.join(resolved) or 'nothing'} (loopback) and {spans}: "
        f"gloo (stage 1's barriers, the checkpoint agreement) would bind every rank here to loopback, where ranks "
        f"on other nodes cannot reach it (the first collective hangs). Set GLOO_SOCKET_IFNAME on every node to the "
        f"interface the nodes reach each other through, here {_suggest(master)}, or make the hostname resolve to "
        f"that interface's address (/etc/hosts)",
        certain,
    )


def check_gloo_network(env: Mapping[str, str] | None = None) -> None:
    """Refuse a multi-node job whose gloo ranks would bind to loopback (a warning where it may be one node)."""
    found = gloo_network_problem(env)
    if found is None:
        return
    problem, certain = found
    if certain:
        raise ConfigError(problem)
    log.warning("%s", problem)
