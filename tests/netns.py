"""A second "machine" for remote-worker tests: a network namespace joined by a veth pair.

The pool binds on the host side of the pair; workers run inside the namespace
(``ip netns exec``) and reach it over a real network interface. Where
namespaces cannot be made (not root, no iproute2), tests fall back to
127.0.0.1 and say why. Only addresses made here are ever used.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess


@dataclasses.dataclass
class RemoteHost:
    namespace: str | None  # None: the loopback fallback
    pool_ip: str  # where the pool binds, reachable from the namespace
    why_not: str = ""

    def command(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *argv] if self.namespace else argv


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def make_remote_host() -> RemoteHost:
    tag = os.getpid() % 10_000
    name, host_if, ns_if = f"zmqp{tag}", f"zp{tag}a", f"zp{tag}b"
    # pytest-xdist's workers (gw0, gw1) make their hosts at once: one takes odd
    # subnets and the other even ones, so two hosts never share a route.
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    octet = (tag % 125) * 2 + 1 + worker % 2
    pool_ip, worker_ip = f"10.213.{octet}.1", f"10.213.{octet}.2"
    if shutil.which("ip") is None or os.geteuid() != 0:
        return RemoteHost(None, "127.0.0.1", "needs root and iproute2's ip")
    try:
        _run("ip", "netns", "add", name)
        _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _run("ip", "link", "set", ns_if, "netns", name)
        _run("ip", "addr", "add", f"{pool_ip}/30", "dev", host_if)
        _run("ip", "link", "set", host_if, "up")
        for argv in (
            ["addr", "add", f"{worker_ip}/30", "dev", ns_if],
            ["link", "set", ns_if, "up"],
        ):
            _run("ip", "netns", "exec", name, "ip", *argv)
        _run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
    except (subprocess.SubprocessError, OSError) as err:
        remove_remote_host(RemoteHost(name, pool_ip))
        return RemoteHost(None, "127.0.0.1", f"ip netns failed: {err}")
    return RemoteHost(name, pool_ip)


def remove_remote_host(host: RemoteHost) -> None:
    if host.namespace is None:
        return
    tag = host.namespace.removeprefix("zmqp")
    subprocess.run(["ip", "link", "del", f"zp{tag}a"], capture_output=True, timeout=30)
    subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True, timeout=30)


def free_port_base(ip: str, count: int = 3) -> int:
    """A port P such that P..P+count-1 are free on ``ip`` now (the pool binds all three)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((ip, 0))
            base = probe.getsockname()[1]
        if base + count < 65535 and all(_free(ip, base + i) for i in range(count)):
            return base
    raise OSError(f"no {count} consecutive free ports on {ip}")


def _free(ip: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((ip, port))
        except OSError:
            return False
    return True
