"""A free TCP port on this host, for a rendezvous that nobody named (one node, one process or several)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the OS's pick on loopback); another process may still take it before use."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
