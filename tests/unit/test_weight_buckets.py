"""Bucket planning (pure) and the ZMQ transport between two threads, without an engine."""

import os
import stat
import threading
import time

import pytest
import torch

from agentgym_mega.weight_sync import SyncError
from agentgym_mega.weight_sync.buckets import Segment, pack
from agentgym_mega.weight_sync.handles import rewrite_device
from agentgym_mega.weight_sync.ipc_ring import RING_SLOTS, CudaIpcSender
from agentgym_mega.weight_sync.zmq_receiver import ZmqWeightReceiver
from agentgym_mega.weight_sync.zmq_sender import ZmqWeightSender, endpoint
from tests.unit.weight_sync_peers import SECRET, HandMadeTrainer


def plan(sizes_in_floats, bucket_bytes):
    """Segments of each bucket for float32 tensors of the given sizes."""
    tensors = [(f"t{i}", torch.zeros(n)) for i, n in enumerate(sizes_in_floats)]
    return [b.segments for b in pack(tensors, bucket_bytes)]


def test_small_tensors_share_a_bucket_until_it_is_full():
    # 3 tensors of 16, 8 and 8 bytes; buckets of 24 bytes: [t0 + t1], [t2]
    assert plan([4, 2, 2], 24) == [
        [Segment(0, 0, 16), Segment(1, 0, 8)],
        [Segment(2, 0, 8)],
    ]


def test_a_tensor_larger_than_a_bucket_is_split_across_buckets():
    # 40-byte tensor with 16-byte buckets: 16 + 16 + 8, then the next tensor fills the remainder
    assert plan([10, 2], 16) == [
        [Segment(0, 0, 16)],
        [Segment(0, 16, 16)],
        [Segment(0, 32, 8), Segment(1, 0, 8)],
    ]


def test_tensors_straddle_buckets_so_every_bucket_but_the_last_is_full():
    # 8, 12 and 20 bytes with 16-byte buckets
    assert plan([2, 3, 5], 16) == [
        [Segment(0, 0, 8), Segment(1, 0, 8)],
        [Segment(1, 8, 4), Segment(2, 0, 12)],
        [Segment(2, 12, 8)],
    ]


def test_buckets_of_exactly_one_tensor_and_zero_size_tensors():
    assert plan([4, 4], 16) == [[Segment(0, 0, 16)], [Segment(1, 0, 16)]]
    assert plan([0, 4], 16) == [[Segment(1, 0, 16)]]  # empty tensors need no bytes


def test_payloads_share_memory_and_specs_travel_with_their_first_bucket():
    big, small = torch.arange(10.0), torch.ones(2)
    buckets = list(pack([("big", big), ("small", small)], 16))
    assert [sorted(b.specs) for b in buckets] == [[0], [], [1]]
    assert buckets[2].specs[1].shape == (2,) and buckets[2].specs[1].dtype == "float32"
    assert buckets[0].payloads[0].data_ptr() == big.data_ptr()  # zero-copy view, not a copy
    assert torch.equal(torch.cat([p for b in buckets for p in b.payloads]),
                       torch.cat([big.view(torch.uint8), small.view(torch.uint8)]))


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(pack([("t", torch.zeros(1))], 0))


def _roundtrip(tensors, bucket_bytes, timeout_s=10.0, address=None, cuda_ipc=False, secret=None):
    sender = (CudaIpcSender if cuda_ipc else ZmqWeightSender)(address, bucket_bytes=bucket_bytes,
                                                               timeout_s=timeout_s, secret=secret)
    out = {}

    def receive():
        receiver = ZmqWeightReceiver(sender.address, timeout_s, secret=secret)
        out["version"], out["tensors"] = receiver.receive()
        receiver.reply(out["version"])
        receiver.close()

    thread = threading.Thread(target=receive)
    thread.start()
    stats = sender.push(iter(tensors), version=7)  # a one-pass iterator, as export_hf yields
    thread.join()
    sender.close()
    return stats, out


@pytest.mark.parametrize("bucket_bytes", [7, 64, 1 << 30], ids=["tiny-odd", "small", "one-bucket"])
def test_transport_delivers_every_dtype_bitwise(bucket_bytes):
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("embed", torch.randn(33, 5, generator=g)),
        ("bf16", torch.randn(3, 7, generator=g).to(torch.bfloat16)),
        ("empty", torch.zeros(0, 4)),
        ("ints", torch.arange(10, dtype=torch.int64)),
        ("scalar", torch.tensor(3.5)),
    ]
    stats, out = _roundtrip(tensors, bucket_bytes)
    assert out["version"] == 7 and stats.version == 7
    assert [n for n, _ in out["tensors"]] == [n for n, _ in tensors]
    for (_, sent), (_, got) in zip(tensors, out["tensors"]):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got, sent)
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in tensors)
    assert stats.params == sum(t.numel() for _, t in tensors)


def test_receiver_times_out_when_no_trainer_sends():
    sender = ZmqWeightSender(timeout_s=1.0)  # bound, but never pushes
    receiver = ZmqWeightReceiver(sender.address, timeout_s=0.5)
    with pytest.raises(SyncError, match="stalled"):
        receiver.receive()
    receiver.close()
    sender.close()


def test_sender_times_out_without_engines():
    sender = ZmqWeightSender(timeout_s=0.5)
    with pytest.raises(SyncError, match="no READY"):
        sender.push([("w", torch.ones(2))], version=1)
    sender.close()


def _raw_stream(messages):
    """A trainer that sends hand-made multipart messages after the handshake."""
    trainer = HandMadeTrainer(messages)
    receiver = ZmqWeightReceiver(trainer.address, timeout_s=2.0, secret=SECRET)
    try:
        return receiver.receive()
    finally:
        receiver.close()
        trainer.close()


def _bucket(nbytes_per_segment):
    return {"op": "BUCKET", "specs": {"0": ["w", "uint8", [sum(nbytes_per_segment)]]},
            "segments": [[0, sum(nbytes_per_segment[:i]), n] for i, n in enumerate(nbytes_per_segment)]}


@pytest.mark.parametrize("frames,error", [
    ([_bucket([4, 4]), b"abcd"], "bytes 4-8 of w is missing"),
    ([_bucket([4]), b"abcdef"], "bytes 0-4 of w has 6 bytes, expected 4"),
    ([_bucket([4]), b"abcd", b"more"], "more frames than it announced"),
    ([b"\x00\x01 not json"], "expected a header"),
], ids=["missing-frame", "wrong-size", "extra-frame", "not-a-header"])
def test_a_malformed_stream_is_a_sync_error(frames, error):
    with pytest.raises(SyncError, match=error):
        _raw_stream([frames])


@pytest.mark.parametrize("transport,expected", [("ipc", "ipc://"), ("tcp", "tcp://10.0.0.1:0")])
def test_the_zmq_endpoint_of_each_transport(transport, expected):
    address = endpoint(transport, "10.0.0.1")
    assert address.startswith(expected)
    if address.startswith("ipc://"):  # a fresh private directory, which no sender bound here
        directory = os.path.dirname(address.removeprefix("ipc://"))
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        os.rmdir(directory)



def test_a_whole_sync_travels_over_tcp():
    tensors = [("a", torch.arange(5.0)), ("b", torch.ones(2, 2))]  # 36 bytes
    address = endpoint("tcp", "127.0.0.1")
    stats, out = _roundtrip(tensors, bucket_bytes=8, address=address, secret=SECRET)
    assert stats.version == 7 and stats.buckets == 5
    assert [(n, t.tolist()) for n, t in out["tensors"]] == [(n, t.tolist()) for n, t in tensors]


def test_handle_messages_go_through_a_ring_of_bucket_slots():
    # The CUDA IPC path's messages and the ring's flow control (a slot is refilled only after the
    # engine freed it); for CPU tensors a handle carries its slot's bytes, so the framing is
    # checked here and the GPU itself in tests/gpu. 58 bytes in 8-byte slots: 8 buckets, 3 slots.
    tensors = [("a", torch.arange(12.0).view(3, 4)), ("b", torch.ones(5, dtype=torch.bfloat16))]
    stats, out = _roundtrip(tensors, bucket_bytes=8, cuda_ipc=True)
    assert stats.buckets == 8 and stats.tensors == 2 and RING_SLOTS == 3
    for (_, sent), (_, got) in zip(tensors, out["tensors"]):
        assert got.dtype == sent.dtype and torch.equal(got, sent)


def test_the_sender_never_runs_more_than_the_ring_ahead_of_the_engine():
    tensors = [("a", torch.arange(64.0))]  # 256 bytes: 32 buckets of 8
    sender = CudaIpcSender(bucket_bytes=8, timeout_s=10.0)
    freed, ahead = [0], []

    def receive():
        receiver = ZmqWeightReceiver(sender.address, 10.0)
        send = receiver._sock.send

        def counting(frame, *args, **kwargs):  # the engine's FREE messages, as they leave
            freed[0] += b'"FREE"' in frame
            return send(frame, *args, **kwargs)

        receiver._sock.send = counting
        for _ in receiver.stream(7):
            time.sleep(0.001)
        receiver.reply(7)
        receiver.close()

    thread = threading.Thread(target=receive)
    thread.start()
    stats = sender.push(iter(tensors), version=7, progress=lambda sent, messages: ahead.append(messages - freed[0]))
    thread.join()
    sender.close()
    assert stats.buckets == 32 and len(ahead) == 32 and max(ahead) <= 3  # the ring's 3 slots


# rebuild_cuda_tensor's arguments as reduce_tensor makes them, the device index at position 6
HANDLE_ARGS = ("Tensor", (3, 4), (4, 1), 0, "TypedStorage", "float32", 0, b"handle", 48, 0, False, b"ref", 0,
               b"event", True)
GPUS = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc"]  # this process's devices 0, 1, 2


@pytest.mark.parametrize("sender,expected", [("GPU-aaaa", 0), ("GPU-cccc", 2)])
def test_a_cuda_handle_names_the_engines_own_index_of_the_same_gpu(sender, expected):
    rewritten = rewrite_device(HANDLE_ARGS, sender, GPUS)
    assert rewritten[6] == expected
    assert rewritten[:6] == HANDLE_ARGS[:6] and rewritten[7:] == HANDLE_ARGS[7:]


@pytest.mark.parametrize("sender,error", [("GPU-dddd", "which this engine worker cannot see"),
                                          (None, "without the sender's device UUID")])
def test_a_cuda_handle_from_a_gpu_the_engine_cannot_see_is_refused(sender, error):
    with pytest.raises(SyncError, match=error):
        rewrite_device(HANDLE_ARGS, sender, GPUS)
