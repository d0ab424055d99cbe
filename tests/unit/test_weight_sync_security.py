"""The weight path's protections, without an engine: no pickles off ipc://, authenticated peers
only, ACKs of the version sent, no tcp:// without a secret, a private ipc:// socket."""

import io
import os
import pickle
import stat
import threading

import pytest
import torch

from agentgym_mega.weight_sync import SyncError, new_secret, zmq_receiver
from agentgym_mega.weight_sync.auth import proof
from agentgym_mega.weight_sync.handles import HandleUnpickler
from agentgym_mega.weight_sync.ipc_ring import RING_SLOTS, CudaIpcSender
from agentgym_mega.weight_sync.zmq_receiver import ZmqWeightReceiver
from agentgym_mega.weight_sync.zmq_sender import ZmqWeightSender
from agentgym_mega.weight_sync.zmq_transport import ZmqWeightSynchronizer
from tests.unit.weight_sync_peers import (
    OTHER_SECRET,
    SECRET,
    HandMadeTrainer,
    Impostor,
    handle_message,
    malicious_handle,
)

TENSORS = [("a", torch.arange(6.0)), ("b", torch.ones(2, 3, dtype=torch.bfloat16))]


def _push_in_thread(sender, tensors=TENSORS, version=7, receivers=1):
    out = {}

    def push():
        try:
            out["stats"] = sender.push(iter(tensors), version=version, receivers=receivers)
        except Exception as exc:
            out["error"] = exc

    thread = threading.Thread(target=push)
    thread.start()
    return thread, out


def _receive(address, secret=SECRET, version=None, ack=None, timeout_s=10.0):
    receiver = ZmqWeightReceiver(address, timeout_s, secret=secret)
    try:
        got, tensors = receiver.receive(version)
        receiver.reply(got if ack is None else ack)
        return got, tensors
    finally:
        receiver.close()


# -- 1. no pickles off ipc:// ---------------------------------------------------------------

def test_the_malicious_handle_really_runs_code_when_unpickled(tmp_path):
    # The control for the tests below: loading this payload as the receiver once did creates the file.
    marker = tmp_path / "pwned"
    fn, args = pickle.loads(malicious_handle(str(marker)))
    assert marker.exists()


def _unrestricted_loader(calls):
    """The receiver's handle loading as it was before the fix (plain pickle), recording calls."""
    def load(data, spec, sender_uuid):
        calls.append(spec.name)
        fn, args = pickle.loads(data)
        return fn(*args)
    return load


def test_a_handle_over_tcp_is_refused_without_unpickling_it(tmp_path, monkeypatch):
    # The trainer here holds the secret and passes the handshake: the transport alone must stop
    # the pickle. Handles are loaded the unsafe way, so only the transport check is tested.
    calls = []
    monkeypatch.setattr(zmq_receiver, "load_handle", _unrestricted_loader(calls))
    marker = tmp_path / "pwned"
    trainer = HandMadeTrainer([handle_message(str(marker)), [{"op": "COMMIT", "version": 7, "tensors": 1}]])
    receiver = ZmqWeightReceiver(trainer.address, timeout_s=5.0, secret=SECRET)
    try:
        with pytest.raises(SyncError, match=r"refusing a CUDA IPC HANDLE frame over tcp://"):
            receiver.receive(7)
    finally:
        receiver.close()
        trainer.close()
    assert calls == [] and not marker.exists()


def test_the_allowed_transport_comes_from_the_address_connected_to(tmp_path):
    # Whatever the trainer announces, only an ipc:// socket file may carry handles.
    receiver = ZmqWeightReceiver(f"ipc://{tmp_path}/weights.sock")
    assert receiver.handles_allowed
    receiver.close()
    for address in ("tcp://127.0.0.1:1", "ipc://@abstract-name", "inproc://weights"):
        receiver = ZmqWeightReceiver(address, secret=SECRET)
        assert not receiver.handles_allowed, address
        receiver.close()


def test_over_ipc_a_handle_naming_anything_but_torch_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    trainer = HandMadeTrainer([handle_message(str(marker))], address=f"ipc://{tmp_path}/weights.sock")
    receiver = ZmqWeightReceiver(trainer.address, timeout_s=5.0, secret=SECRET)
    try:
        with pytest.raises(SyncError, match=r"refusing a CUDA IPC handle that names io.open"):
            receiver.receive(7)
    finally:
        receiver.close()
        trainer.close()
    assert not marker.exists()


def test_genuine_handles_still_travel_over_ipc():
    # 8-byte slots: 36 bytes take 5 buckets through a ring of 3, so slots are freed and reused
    # (on CPU a handle carries its slot's bytes, on a GPU it maps the trainer's memory)
    sender = CudaIpcSender(bucket_bytes=8, timeout_s=10.0, secret=SECRET)
    thread, out = _push_in_thread(sender)
    got, tensors = _receive(sender.address)
    thread.join()
    sender.close()
    assert out["stats"].buckets == 5 > RING_SLOTS and got == 7
    for (_, sent), (_, received) in zip(TENSORS, tensors):
        assert received.dtype == sent.dtype and torch.equal(received, sent)


def test_a_sender_refuses_handles_off_ipc():
    with pytest.raises(SyncError, match="ipc:// socket file only"):
        CudaIpcSender("tcp://127.0.0.1:0", secret=SECRET)


# -- 2. authenticated peers only --------------------------------------------------------------

def test_peers_without_the_secret_get_no_weights_and_the_engines_sync(tmp_path):
    sender = ZmqWeightSender("tcp://127.0.0.1:0", bucket_bytes=8, timeout_s=10.0, secret=SECRET)
    thread, out = _push_in_thread(sender)
    silent, no_hello, no_proof, wrong, garbage, stalled = (Impostor(sender.address) for _ in range(6))
    try:
        no_hello.send({"op": "READY", "proof": "0" * 64})
        assert no_hello.next()["op"] == "ERROR"
        for peer, ready in ((no_proof, {"op": "READY"}), (wrong, None)):
            peer.send({"op": "HELLO", "nonce": "ab" * 16})
            challenge = peer.next()
            assert challenge["op"] == "CHALLENGE"
            if ready is None:  # a proof made with another secret
                ready = {"op": "READY", "proof": proof(
                    OTHER_SECRET.encode(), "engine", "ab" * 16, challenge["nonce"], challenge["version"])}
            peer.send(ready)
            reply = peer.next()
            assert reply["op"] == "ERROR" and "authentication failed" in reply["message"]
        garbage.send(b"\x80 not json", b"extra frame")
        assert garbage.next()["op"] == "ERROR"
        stalled.send({"op": "HELLO", "nonce": "cd" * 16})
        assert stalled.next()["op"] == "CHALLENGE"  # and never answers
        # None of them counted as the one receiver: the genuine engine still gets everything.
        got, tensors = _receive(sender.address)
        thread.join()
        assert "error" not in out, out.get("error")
        assert out["stats"].receivers == 1 and got == 7
        assert all(torch.equal(r, s) for (_, r), (_, s) in zip(tensors, TENSORS))
        for peer in (silent, no_hello, no_proof, wrong, garbage, stalled):
            peer.drain()
            # control messages only: one frame each, never a BUCKET, a weight frame or a COMMIT
            assert all(b'"op": "ERROR"' in f or b'"op": "CHALLENGE"' in f for f in peer.frames), peer.frames
        assert silent.frames == [] and sender.refused == 4
    finally:
        for peer in (silent, no_hello, no_proof, wrong, garbage, stalled):
            peer.close()
        sender.close()


def test_an_engine_with_another_secret_is_not_served_and_refuses_the_trainer():
    sender = ZmqWeightSender("tcp://127.0.0.1:0", timeout_s=1.5, secret=SECRET)
    thread, out = _push_in_thread(sender)
    # The engine checks the trainer's proof first: with another secret it never says READY.
    with pytest.raises(SyncError, match="did not prove it holds the run's secret"):
        _receive(sender.address, secret=OTHER_SECRET)
    thread.join()
    sender.close()
    assert isinstance(out.get("error"), SyncError) and "no READY" in str(out["error"])


def test_an_engine_reads_no_weights_from_a_trainer_without_the_secret():
    for secret in (OTHER_SECRET, None):
        trainer = HandMadeTrainer([[{"op": "COMMIT", "version": 7, "tensors": 0}]], secret=secret)
        receiver = ZmqWeightReceiver(trainer.address, timeout_s=5.0, secret=SECRET)
        try:
            with pytest.raises(SyncError, match="did not prove it holds the run's secret"):
                receiver.receive(7)
        finally:
            receiver.close()
            trainer.close()
        assert trainer.replies == []  # no READY was ever sent


def test_the_synchronizer_hands_the_secret_to_each_engine():
    class Engine:
        def receive_weights(self, receiver):
            got, _ = _receive(receiver.address, secret=receiver.secret, version=receiver.version)
            self.got = got
            return got

    engines = [Engine(), Engine()]
    synchronizer = ZmqWeightSynchronizer("tcp://127.0.0.1:0", bucket_bytes=16, timeout_s=10.0, secret=SECRET)
    try:
        stats = synchronizer.sync(TENSORS, engines, version=3)
    finally:
        synchronizer.close()
    assert stats.receivers == 2 and [e.got for e in engines] == [3, 3]


def test_admitted_engines_hear_at_once_when_the_trainer_gives_up():
    def failing():
        yield TENSORS[0]
        raise RuntimeError("gather failed")

    sender = ZmqWeightSender("tcp://127.0.0.1:0", bucket_bytes=8, timeout_s=10.0, secret=SECRET)
    thread, out = _push_in_thread(sender, tensors=failing())
    with pytest.raises(SyncError, match="the trainer stopped sending version 7"):
        _receive(sender.address, timeout_s=30.0)  # well before its own timeout
    thread.join()
    sender.close()
    assert "gather failed" in str(out["error"])


# -- 3. versions ------------------------------------------------------------------------------

def test_an_ack_of_another_version_is_a_sync_error():
    sender = ZmqWeightSender(timeout_s=10.0, secret=SECRET)
    thread, out = _push_in_thread(sender, version=7)
    _receive(sender.address, ack=6)
    thread.join()
    sender.close()
    assert isinstance(out.get("error"), SyncError)
    assert "acknowledged version 6, but the trainer sent version 7" in str(out["error"])


def test_an_engine_refuses_a_stream_of_another_version():
    sender = ZmqWeightSender(timeout_s=1.5)
    thread, out = _push_in_thread(sender, version=7)
    with pytest.raises(SyncError, match="sending version 7, this engine expects version 8"):
        _receive(sender.address, secret=None, version=8)
    thread.join()
    sender.close()
    assert "no READY" in str(out["error"])  # it never counted as a receiver
    trainer = HandMadeTrainer([[{"op": "COMMIT", "version": 9, "tensors": 0, "bytes": 0}]])
    receiver = ZmqWeightReceiver(trainer.address, timeout_s=5.0, secret=SECRET)
    try:
        with pytest.raises(SyncError, match="committed version 9, this engine expects version 7"):
            receiver.receive(7)
    finally:
        receiver.close()
        trainer.close()


# -- 4. no tcp:// without a secret; a private ipc:// socket ------------------------------------

@pytest.mark.parametrize("address", ["tcp://127.0.0.1:0", "tcp://*:0", "ipc://@agentgym-abstract"])
def test_a_reachable_address_without_a_secret_is_refused(address):
    with pytest.raises(SyncError, match="without a secret"):
        ZmqWeightSender(address)
    with pytest.raises(SyncError, match="without a secret"):
        ZmqWeightSynchronizer(address)
    with pytest.raises(SyncError, match="without a secret"):
        ZmqWeightReceiver(address.replace(":0", ":5555"))


@pytest.mark.parametrize("secret,error", [(b"short", ValueError), ("x" * 31, ValueError), (12345, TypeError)])
def test_a_weak_secret_is_refused(secret, error):
    with pytest.raises(error):
        ZmqWeightSender("tcp://127.0.0.1:0", secret=secret)


def test_new_secrets_are_fresh_and_long_enough():
    a, b = new_secret(), new_secret()
    assert a != b and len(bytes.fromhex(a)) == 32


def test_the_ipc_socket_is_reachable_by_its_owner_only():
    sender = ZmqWeightSender()
    path = sender.address.removeprefix("ipc://")
    directory = os.path.dirname(path)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) & 0o077 == 0
    sender.close()
    assert not os.path.exists(directory)  # cleaned up with the socket


def test_a_socket_file_outside_a_private_directory_is_made_private(tmp_path):
    os.chmod(tmp_path, 0o755)
    sender = ZmqWeightSender(f"ipc://{tmp_path}/weights.sock")
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "weights.sock").st_mode) == 0o600
    finally:
        sender.close()


def test_the_handle_unpickler_admits_what_a_cuda_handle_consists_of():
    # reduce_tensor's output for a CUDA tensor, with made-up handles (no GPU here): every name in
    # it must resolve, or CUDA IPC would break on GPU machines.
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    for cls in (torch.Tensor, torch.nn.Parameter):
        handle = (rebuild_cuda_tensor, (cls, torch.Size([3, 4]), (4, 1), 0, torch.storage.TypedStorage,
                                        torch.bfloat16, 0, b"h" * 64, 96, 0, False, b"r" * 64, 0, b"e" * 64, True))
        loaded = HandleUnpickler(io.BytesIO(pickle.dumps(handle))).load()
        assert loaded == handle
