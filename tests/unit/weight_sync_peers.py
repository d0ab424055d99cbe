"""Hand-made peers of the weight-sync protocol for tests: a trainer that sends whatever frames a
test gives it after the handshake, and a raw engine-side socket for impostors."""

from __future__ import annotations

import json
import pickle
import secrets
import threading

import zmq

from agentgym_mega.weight_sync.auth import new_secret, proof

SECRET = new_secret()
OTHER_SECRET = new_secret()


def frame(f) -> bytes:
    return json.dumps(f).encode() if isinstance(f, dict) else f


class HandMadeTrainer:
    """A ROUTER bound at `address` (a free tcp port on 127.0.0.1 by default) that answers one
    engine's HELLO with a CHALLENGE (a valid proof of `secret`, or none when it is None), waits
    for READY, then sends `messages` (lists of frames; dicts go as JSON) and keeps the replies."""

    def __init__(self, messages, secret=SECRET, version=7, address=None):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if address is None:
            address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        else:
            self.sock.bind(address)
        self.address, self.messages, self.secret, self.version = address, messages, secret, version
        self.replies: list[dict] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _wait(self, timeout_s: float) -> bool:
        """Whether a message arrived within `timeout_s`; gives up early once close() was called."""
        for _ in range(int(timeout_s * 10)):
            if self.sock.poll(100):
                return True
            if self._stop.is_set():
                return False
        return False

    def _serve(self):
        if not self._wait(30):
            return
        peer, hello = self.sock.recv_multipart()
        engine_nonce, ours = json.loads(hello)["nonce"], secrets.token_hex(16)
        challenge = {"op": "CHALLENGE", "nonce": ours, "version": self.version}
        if self.secret is not None:
            challenge["proof"] = proof(self.secret.encode(), "trainer", engine_nonce, ours, self.version)
        self.sock.send_multipart([peer, frame(challenge)])
        if not self._wait(30):
            return  # the engine refused us
        self.replies.append(json.loads(self.sock.recv_multipart()[-1]))
        if self.replies[-1].get("op") != "READY":
            return
        for frames in self.messages:
            self.sock.send_multipart([peer, *[frame(f) for f in frames]])
        while self._wait(30) or self.sock.poll(200):  # replies, and those in flight at close()
            self.replies.append(json.loads(self.sock.recv_multipart()[-1]))

    def close(self):
        self._stop.set()
        self.thread.join(timeout=30)
        self.sock.close(linger=0)


class Impostor:
    """A raw DEALER connected to a sender; records every frame it is ever sent."""

    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.frames: list[bytes] = []

    def send(self, *frames) -> None:
        self.sock.send_multipart([frame(f) for f in frames])

    def next(self, timeout_s: float = 5.0) -> dict | None:
        """The next message (JSON), or None if none comes."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        frames = self.sock.recv_multipart()
        self.frames.extend(frames)
        return json.loads(frames[0])

    def drain(self) -> None:
        while self.next(timeout_s=0.2) is not None:
            pass

    def close(self) -> None:
        self.sock.close(linger=0)


class Boom:
    """Unpickling this (as `pickle.loads` would) creates the file `marker`: a stand-in for code
    execution that a test can observe."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def malicious_handle(marker: str) -> bytes:
    """A HANDLE frame's payload shaped like (rebuild_fn, args) whose loading creates `marker`."""
    return pickle.dumps((Boom(marker), ()))


def handle_message(marker: str, name: str = "model.norm.weight", shape=(128,)) -> list:
    """A CUDA IPC bucket slot holding one tensor, whose handle is `malicious_handle`."""
    nbytes = 4 * shape[0]
    return [{"op": "HANDLE", "slot": 0, "slot_bytes": nbytes, "nbytes": nbytes,
             "specs": {"0": [name, "float32", list(shape)]}, "segments": [[0, 0, nbytes]]}, malicious_handle(marker)]
