"""Addresses processes of one job use to reach each other, and ports taken without a race: a port
found free and handed to a process that binds it later can be taken by another in between, so
servers bind port 0 and report what they got, and a rendezvous store is bound before the ranks that
dial it exist. Imports of torch and Ray are deferred: the server launcher runs without them."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading

# torchrun's switch (torch.distributed.rendezvous): every env:// rank, rank 0 included, dials the
# store at MASTER_ADDR:MASTER_PORT instead of rank 0 binding that port itself.
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
# What our servers print on stderr once their socket is bound: "serving ... on http://HOST:PORT ...".
_SERVING = re.compile(r"^serving .* on (http://\S+)")


def reachable_ip() -> str:
    """Loopback when the job runs on this one machine (no Ray, or a one-node Ray cluster), the
    node's IP on a multi-node Ray cluster."""
    import ray

    if not ray.is_initialized() or len(ray.nodes()) == 1:
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


def host_rendezvous(host: str = "127.0.0.1"):
    """torch.distributed's rendezvous store, bound here on a port the OS picks, and the variables
    that make env:// ranks join it, as torchrun's agent does. Returns (store, variables): the port
    stays bound while the store object lives; one store serves one launch of ranks (a second would
    find the first one's keys)."""
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)
    return store, {"MASTER_ADDR": host, "MASTER_PORT": str(store.port), AGENT_STORE_ENV: "True"}


def start_server(command: list[str], timeout_s: float = 300.0, **popen) -> tuple[subprocess.Popen, str]:
    """Starts `agentgym-mega COMMAND --port 0` (env-server, retriever serve) and returns the process
    and the URL its start-up line names: the OS picks the port as the server binds it. The server's
    stderr still reaches ours (a thread copies it). Raises RuntimeError, the process ended, if the
    server exits or names no URL within `timeout_s`."""
    proc = subprocess.Popen([sys.executable, "-m", "agentgym_mega.cli", *command, "--port", "0"],
                            stderr=subprocess.PIPE, **popen)
    urls: queue.Queue = queue.Queue()
    threading.Thread(target=_copy_stderr, args=(proc, urls), daemon=True, name="server-stderr").start()
    try:
        url = urls.get(timeout=timeout_s)
    except queue.Empty:
        url = None
    if url is None:
        proc.kill()
        raise RuntimeError(f"`agentgym-mega {' '.join(command)}` named no URL within {timeout_s:g} s "
                           f"(exit {proc.wait()})")
    return proc, url


def _copy_stderr(proc: subprocess.Popen, urls: queue.Queue) -> None:
    """Copies the server's stderr to ours line by line, putting the URL of its start-up line on
    `urls` (None at the end of its output, for a server that ends first)."""
    for line in proc.stderr:
        os.write(sys.__stderr__.fileno(), line)
        found = _SERVING.match(line.decode(errors="replace"))
        if found:
            urls.put(found.group(1))
    urls.put(None)
