"""Listening sockets of a real process tree, and a network where a local Ray would find a non-loopback address.

The tests run in a loopback-only network namespace (scripts/offline.sh). There Ray's node-IP discovery (a UDP
connect towards a public address) fails and falls back to 127.0.0.1, so a local Ray would bind to loopback even
if memlm did nothing about it: a test of the binding would pass for the wrong reason. `address_namespace()` gives
a command prefix that runs a command in a nested network namespace where the loopback interface also holds
ADDRESS with a default route through it: Ray then discovers ADDRESS, as it discovers a machine's external address
outside the tests, and a server that binds by the node IP or to every interface shows up as not loopback.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import threading
from pathlib import Path

import psutil

ADDRESS = "192.0.2.99"  # TEST-NET-1 (RFC 5737): never routed anywhere

_SETUP = (f"ip link set lo up && ip addr add {ADDRESS}/32 dev lo && ip route add default dev lo src {ADDRESS} "
          '&& exec "$@"')
_PROBE = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect(('8.8.8.8', 53)); "
          "print(s.getsockname()[0])")


def address_namespace() -> list[str]:
    """The command prefix, or [] where no nested network namespace can be made (then the caller's own network)."""
    prefix = ["unshare", "-n" if os.getuid() == 0 else "-rn", "sh", "-c", _SETUP, "sh"]
    try:
        probe = subprocess.run([*prefix, sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return prefix if probe.returncode == 0 and probe.stdout.strip() == ADDRESS else []


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1, an IPv4 loopback socket seen by IPv6
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _address(hex_ip: str) -> str:
    """/proc/net/tcp's address: 32-bit words in host byte order (little-endian here), IPv4 or IPv6."""
    raw = b"".join(int(hex_ip[i:i + 8], 16).to_bytes(4, "little") for i in range(0, len(hex_ip), 8))
    return str(ipaddress.ip_address(raw))


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    except OSError:
        pass
    return inodes


TCP_LISTEN, UDP_UNCONNECTED = "0A", "07"


def listeners(root_pid: int) -> dict[tuple[str, int], str]:
    """(address, port) -> process name for every listening TCP socket and unconnected bound UDP socket of the
    process and its descendants (0.0.0.0 and :: mean every interface). Read from /proc/PID/net/*, the tables of
    each process's own network namespace (psutil reads the caller's)."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    found = {}
    for proc in procs:
        inodes = _socket_inodes(proc.pid)
        for table, state in (("tcp", TCP_LISTEN), ("tcp6", TCP_LISTEN), ("udp", UDP_UNCONNECTED),
                             ("udp6", UDP_UNCONNECTED)):
            try:
                lines = Path(f"/proc/{proc.pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if fields[3] != state or fields[9] not in inodes:
                    continue
                hex_ip, hex_port = fields[1].split(":")
                try:
                    name = proc.name()
                except psutil.NoSuchProcess:
                    name = f"pid {proc.pid}"
                found[(_address(hex_ip), int(hex_port, 16))] = name
    return found


class ListenerWatch(threading.Thread):
    """Samples listeners(pid) until stopped, keeping every socket seen (servers come and go with trials)."""

    def __init__(self, pid: int, interval: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.seen: dict[tuple[str, int], str] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.seen.update(listeners(self.pid))
            self.halt.wait(self.interval)

    def finish(self) -> dict[tuple[str, int], str]:
        self.halt.set()
        self.join(timeout=30)
        return self.seen

    def not_loopback(self) -> list[str]:
        return sorted(f"{ip}:{port} ({name})" for (ip, port), name in self.seen.items() if not is_loopback(ip))
