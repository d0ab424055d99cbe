"""Addresses processes of one job use to reach each other."""

from __future__ import annotations

import socket


def reachable_ip() -> str:
    """Loopback when the job runs on this one machine (no Ray, or a one-node Ray cluster), the
    node's IP on a multi-node Ray cluster."""
    import ray

    if not ray.is_initialized() or len(ray.nodes()) == 1:
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
