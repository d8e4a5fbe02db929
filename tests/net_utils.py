"""Which TCP sockets a process listens on, read from /proc (Linux, stdlib only): for tests of what is exposed.

``/proc/<pid>/net/tcp`` and ``tcp6`` list every socket of the process's network namespace; the ones the
process owns are those whose inode is behind one of its ``/proc/<pid>/fd`` links.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path

_LISTEN = "0A"  # TCP_LISTEN in the kernel's st column


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for link in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(link)
        except OSError:  # closed between listing and reading
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def decode_address(hex_address: str) -> str:
    """A kernel hex address (32-bit words in host order: little-endian here) as text; IPv4-mapped as IPv4."""
    raw = b"".join(bytes.fromhex(hex_address[i:i + 8])[::-1] for i in range(0, len(hex_address), 8))
    address = ipaddress.ip_address(raw)
    if address.version == 6 and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def _listeners_in(table: Path, inodes: set[int]) -> list[tuple[str, int]]:
    found = []
    for line in table.read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == _LISTEN and int(fields[9]) in inodes:
            address, port = fields[1].split(":")
            found.append((decode_address(address), int(port, 16)))
    return found


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process ``pid`` holds, IPv4 and IPv6."""
    inodes = _socket_inodes(pid)
    found = []
    for name in ("tcp", "tcp6"):
        table = Path(f"/proc/{pid}/net/{name}")
        if table.exists():
            found.extend(_listeners_in(table, inodes))
    return sorted(found)


def non_loopback(sockets: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The sockets not on 127.0.0.0/8 or ::1; a wildcard (0.0.0.0, ::) is one of them."""
    return [(address, port) for address, port in sockets if not ipaddress.ip_address(address).is_loopback]


def _parent(pid: str) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # exited meanwhile
        return None
    return int(stat.rpartition(")")[2].split()[1])  # after the command name, which may hold spaces and ")"


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, their children, ...), from the parent ids in /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (parent := _parent(entry)) is not None:
            children.setdefault(parent, []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found.extend(below)
        frontier.extend(below)
    return sorted(found)


def drain(sock: socket.socket) -> bytes:
    """Everything a peer sends until it closes (a reset ends it too)."""
    data = bytearray()
    try:
        while chunk := sock.recv(1 << 20):
            data += chunk
    except ConnectionResetError:
        pass
    return bytes(data)
