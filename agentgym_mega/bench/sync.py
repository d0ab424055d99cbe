"""Weight sync throughput: megatron-core shards -> HF tensors -> ZMQ buckets -> a vLLM engine,
against the raw ZMQ rate of the same bytes measured in the same run, plus log-prob parity of
the engine with the trainer after the last sync.

As in training, a sync follows each optimizer step. The first sync into a fresh engine also pays
one-time costs (vLLM's CPU kernels repack the weights into newly allocated memory), so it is
reported apart (`first_*`); `seconds` and `gbps`
are the median of the syncs after it, each carrying the new weights of another optimizer step.
The ceiling is the best of as many raw transfers, so the ratio is not flattered by one slow raw
run.

Transport mode (`run_transports`, `bench sync --receivers/--transport`): no megatron, no vLLM. A
synthetic model of about `size_mb` MiB goes from a sender process to 1..N receiver processes over
each real transport, zmq (ZmqWeightSender/Receiver over tcp://) and collective (the gloo chain of
CollectiveSender/Receiver), after one untimed warm-up sync that also sets up the connections or
the group. Per (transport, receivers) it reports the median seconds per sync, timed in the sender
from push() to its return (every receiver acknowledged or voted), and sender_bytes: what left the
sender process per sync, summed over its TCP sockets' kernel counters (TCP_INFO
tcpi_bytes_sent). /proc/self/io wchar is reported too (sender_wchar) but is no measure of what
ZMQ sends: it counts write()/writev() (gloo's path), not send()/sendmsg() (libzmq's)."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import queue
import shutil
import socket
import statistics
import struct
import tempfile
import time
import traceback

import torch
import zmq

from agentgym_mega.config import load_config
from agentgym_mega.models.tiny import TinySpec, make_tiny_model
from agentgym_mega.rollout.batch import PolicyUpdateBatch
from agentgym_mega.rollout.engines import SamplingConfig
from agentgym_mega.weight_sync import new_secret
from agentgym_mega.weight_sync.loopback import TRANSPORTS, LoopbackReceiver, LoopbackSender, open_group

# Ray (and the stack, which starts it) are imported where the megatron mode uses them: the
# transport mode's spawned processes import this module and need neither.

# ~104M parameters: 12 layers of hidden 768 with a 3072-wide MLP (the vocabulary is tiny).
BENCH_MODEL = dict(layers=12, hidden=768, heads=12, kv_heads=4, ffn=3072)


def _drain(address: str, frames: int, done) -> None:
    sock = zmq.Context.instance().socket(zmq.PULL)
    sock.connect(address)
    for _ in range(frames + 1):
        sock.recv(copy=False)
    done.set()


def raw_zmq_gbps(total_bytes: int, frame_bytes: int) -> float:
    """Zero-copy PUSH of `total_bytes` (distinct memory, like the weights) in frames of
    `frame_bytes` to another process over ipc://."""
    data = torch.ones(total_bytes, dtype=torch.uint8).numpy()
    frames = -(-total_bytes // frame_bytes)
    address = f"ipc://{tempfile.mkdtemp(prefix='agentgym-bench-')}/sock"  # a 0700 directory of its own
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.bind(address)
    ctx = mp.get_context("spawn")
    done = ctx.Event()
    proc = ctx.Process(target=_drain, args=(address, frames, done))
    proc.start()
    sock.send(b"", copy=False)  # waits for the connection, untimed
    start = time.perf_counter()
    for i in range(frames):
        sock.send(data[i * frame_bytes : (i + 1) * frame_bytes], copy=False)
    done.wait()
    seconds = time.perf_counter() - start
    proc.join()
    sock.close(linger=0)
    shutil.rmtree(os.path.dirname(address.removeprefix("ipc://")), ignore_errors=True)
    return total_bytes / seconds / 1e9


def config(trained: str, tp: int, bucket_mb: int):
    """The run the benchmark starts: the actor at TP=`tp` holding `trained`, one engine, no env
    servers, no reference policy."""
    return load_config(None, [f"model.path={trained}", f"parallel.world_size={tp}", f"parallel.tp={tp}",
                              "model.dtype=float32", "trainer.lr=1e-4", "algorithm.kl_coef=0.0",
                              "rollout.max_model_len=512", "rollout.max_tokens_per_turn=64",
                              "weight_sync.transport=ipc", f"weight_sync.bucket_mb={bucket_mb}"])


def run(tp: int = 2, bucket_mb: int = 64, repeats: int = 3, model: dict | None = None) -> dict:
    """`model`: TinySpec fields of the synced Qwen2 (default BENCH_MODEL; smaller in smoke tests)."""
    from agentgym_mega.stack import Stack  # ray: see the module's imports

    model = model or BENCH_MODEL
    with tempfile.TemporaryDirectory() as tmp:
        start_model = make_tiny_model(f"{tmp}/start", TinySpec(arch="qwen2", seed=0, **model))
        trained = make_tiny_model(f"{tmp}/trained", TinySpec(arch="qwen2", seed=1, **model))
        cfg = config(trained, tp, bucket_mb)
        # The trainer holds different weights than the engine started with, so the sync must
        # really move them for the log-probs to agree afterwards. The engine has started before
        # the first sync: the clock times the sync, not vLLM's start-up.
        with Stack.start(cfg, env=False, engine_model=start_model) as stack:
            actor, engine = stack.actor, stack.engines[0]
            first = actor.sync_weights([engine], 0)
            syncs = []
            for version in range(1, repeats + 1):
                actor.update(_random_batch(version), 1.0)  # new weights to send
                syncs.append(actor.sync_weights([engine], version))
            ceiling = max(raw_zmq_gbps(first.bytes, bucket_mb << 20) for _ in range(repeats))
            diff = _logprob_gap(actor, engine)
    stats = sorted(syncs, key=lambda s: s.seconds)[len(syncs) // 2]
    return {
        "model": f"qwen2 {model}", "trainer_tp": tp, "bucket_mb": bucket_mb, "repeats": repeats,
        "params": stats.params, "bytes": stats.bytes, "seconds": stats.seconds,
        "gbps": stats.gbps, "ceiling_gbps": ceiling, "fraction_of_ceiling": stats.gbps / ceiling,
        "all_seconds": [s.seconds for s in syncs],
        "gbps_spread": [min(s.gbps for s in syncs), max(s.gbps for s in syncs)],
        # Where the seconds went: producing tensors (the TP gather on the trainer ranks, which
        # overlaps streaming) and the engine's in-place reload after the last byte.
        "gather_seconds": stats.source_seconds, "engine_load_seconds": stats.load_seconds,
        "first_seconds": first.seconds, "first_gbps": first.gbps, "first_engine_load_seconds": first.load_seconds,
        "median_engine_load_seconds": statistics.median(s.load_seconds for s in syncs),
        "logprob_mean_abs_diff": diff.mean().item(), "logprob_max_abs_diff": diff.max().item(),
    }


def _random_batch(seed: int, size: int = 2, length: int = 32) -> PolicyUpdateBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (size, length), generator=g)
    return PolicyUpdateBatch(ids, loss_mask=torch.ones(size, length), old_logprobs=torch.zeros(size, length),
                             advantages=torch.randn(size, length, generator=g))


def _logprob_gap(actor, engine) -> torch.Tensor:
    """|vLLM - trainer| log-probs of the tokens the engine samples from a few prompts."""
    import ray  # see the module's imports

    prompts = [[1, 5, 9, 20, 33, 7], [1, 7, 7, 7], [1, 300, 12, 40]]
    generations = ray.get(engine.generate.remote(prompts, SamplingConfig(max_tokens=16), [0] * len(prompts)))
    width = max(len(p) + len(g.token_ids) for p, g in zip(prompts, generations))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, (p, g) in enumerate(zip(prompts, generations)):
        ids[i, : len(p) + len(g.token_ids)] = torch.tensor(p + g.token_ids)
        mask[i, len(p) : len(p) + len(g.token_ids)] = True
    megatron = actor.logprobs(ids, 1.0)[mask]
    return (megatron - torch.tensor([lp for g in generations for lp in g.logprobs])).abs()


# -- transport mode: zmq vs collective from one sender to N receivers, no megatron, no vLLM --------

_TRANSPORT_TIMEOUT_S = 300.0  # per sync step and per barrier: far above a 256 MiB sync to 4 receivers
_LAYERS = 8


def synthetic_layout(size_mb: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of a decoder-shaped model of about `size_mb` MiB: an fp32 embedding
    (about 30% of the bytes: bigger than a 64 MiB bucket at 256 MiB), 8 layers of fp32 attention
    and bf16 MLP matrices with tiny fp32 norms, biases and a 4-element tensor, and a bf16 head."""
    total = size_mb << 20
    # a layer holds 28 * hidden^2 bytes (+ its small tensors); the layers get ~55% of the total
    hidden = max(64, round(math.sqrt(0.55 * total / (28 * _LAYERS)) / 64) * 64)
    kv, ffn = hidden // 4, 3 * hidden
    layers = []
    for i in range(_LAYERS):
        p = f"layers.{i}."
        layers += [(p + "input_norm.weight", (hidden,), "float32"),
                   (p + "attn.q.weight", (hidden, hidden), "float32"),
                   (p + "attn.q.bias", (hidden,), "float32"),
                   (p + "attn.kv.weight", (2 * kv, hidden), "float32"),
                   (p + "attn.o.weight", (hidden, hidden), "float32"),
                   (p + "attn.scale", (4,), "float32"),
                   (p + "post_norm.weight", (hidden,), "float32"),
                   (p + "mlp.gate_up.weight", (2 * ffn, hidden), "bfloat16"),
                   (p + "mlp.down.weight", (hidden, ffn), "bfloat16")]
    layers.append(("final_norm.weight", (hidden,), "float32"))
    used = sum(_nbytes(shape, dtype) for _, shape, dtype in layers)
    rest = max(total - used, 6 * hidden * 4)
    embed_rows = max(1, rest * 2 // 3 // (hidden * 4))
    head_rows = max(1, (rest - embed_rows * hidden * 4) // (hidden * 2))
    return [("embed.weight", (embed_rows, hidden), "float32"), *layers,
            ("lm_head.weight", (head_rows, hidden), "bfloat16")]


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * (2 if dtype == "bfloat16" else 4)


def _marker(index: int) -> float:
    return float(index % 97) + 0.5  # exact in bf16 and fp32


def _probes(index: int, numel: int, version: int) -> list[tuple[int, float]]:
    """(position, value) of the elements a receiver checks: the version first, markers of the
    tensor's index in the middle and at the end (so a lost, shifted or swapped segment shows)."""
    return [(0, float(version % 128)), (numel // 2, -_marker(index)), (numel - 1, _marker(index))]


def synthetic_model(size_mb: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The tensors of synthetic_layout(size_mb): deterministic random values, probe markers set."""
    g = torch.Generator().manual_seed(seed)
    model = []
    for index, (name, shape, dtype) in enumerate(synthetic_layout(size_mb)):
        tensor = torch.randn(shape, generator=g).to(getattr(torch, dtype))
        flat = tensor.view(-1)
        for position, value in _probes(index, flat.numel(), 0)[1:]:
            flat[position] = value
        model.append((name, tensor))
    return model


def _stamp(model: list[tuple[str, torch.Tensor]], version: int) -> None:
    for _, tensor in model:
        tensor.view(-1)[0] = float(version % 128)


class _Checker:
    """A receiver's check of one version: names, shapes, dtypes and probe values of every tensor."""

    def __init__(self, layout, version: int):
        self.index = {name: (i, shape, dtype) for i, (name, shape, dtype) in enumerate(layout)}
        self.version, self.seen = version, set()

    def check(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.index or name in self.seen:
            raise ValueError(f"version {self.version}: unexpected or repeated tensor {name!r}")
        self.seen.add(name)
        index, shape, dtype = self.index[name]
        if tuple(tensor.shape) != shape or tensor.dtype != getattr(torch, dtype):
            raise ValueError(f"version {self.version}: {name} arrived as {tensor.dtype}{list(tensor.shape)}, "
                             f"sent as {dtype}{list(shape)}")
        flat = tensor.reshape(-1)
        for position, value in _probes(index, flat.numel(), self.version):
            want = torch.tensor(value, dtype=tensor.dtype).item()
            if flat[position].item() != want:
                raise ValueError(f"version {self.version}: {name}[{position}] is {flat[position].item()}, "
                                 f"sent {want}: the transport corrupted the bytes")

    def complete(self) -> None:
        if len(self.seen) != len(self.index):
            raise ValueError(f"version {self.version}: {len(self.seen)} of {len(self.index)} tensors arrived")


def _wchar() -> int:
    """/proc/self/io wchar: bytes this process passed to write()/writev() (not send()/sendmsg())."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def tcp_bytes_sent() -> dict[str, tuple[int, int]]:
    """(bytes sent, of which retransmitted) of each TCP socket of this process, by socket inode
    (TCP_INFO tcpi_bytes_sent and tcpi_bytes_retrans).

    Covers every thread's sockets (libzmq's I/O thread, gloo's pairs): whatever system call wrote
    the bytes, the kernel counts them per connection."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
            dup = os.dup(int(fd))
        except OSError:  # closed meanwhile
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:  # not a socket (any more)
            os.close(dup)
            continue
        try:
            if link.startswith("socket:") and sock.family in (socket.AF_INET, socket.AF_INET6) \
                    and sock.type == socket.SOCK_STREAM:
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
                # tcpi_bytes_sent (Linux >= 4.19) at byte 200; before it, tcpi_bytes_acked (+1: the SYN)
                out[link] = ((struct.unpack_from("Q", info, 200)[0] if len(info) >= 208
                              else max(struct.unpack_from("Q", info, 120)[0] - 1, 0)),
                             struct.unpack_from("Q", info, 208)[0] if len(info) >= 216 else 0)
        except OSError:
            pass
        finally:
            sock.close()  # the duplicate only: the connection stays open
    return out


def sent_since(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> tuple[int, int]:
    """(bytes sent, retransmitted) between two tcp_bytes_sent() readings."""
    return tuple(sum(n[i] - before.get(key, (0, 0))[i] for key, n in after.items()) for i in (0, 1))


def _transport_sender(transport: str, receivers: int, size_mb: int, bucket_bytes: int, repeats: int,
                      secret: str, spec: dict | None, barrier, results) -> None:
    """The sending process: builds the model, then 1 + `repeats` syncs, each started when every
    receiver waits at `barrier` and measured from inside this process."""
    torch.set_num_threads(1)
    sender = None
    try:
        model = synthetic_model(size_mb)
        model_bytes = sum(t.numel() * t.element_size() for _, t in model)
        sender = LoopbackSender(transport, receivers, bucket_bytes, _TRANSPORT_TIMEOUT_S, secret, spec)
        if transport == "zmq":
            results.put(("address", sender.target))
        syncs = []
        for version in range(repeats + 1):
            _stamp(model, version)
            barrier.wait()  # every receiver is ready for this version
            tcp, wchar = tcp_bytes_sent(), _wchar()
            start = time.perf_counter()
            stats = sender.push(model, version)
            seconds = time.perf_counter() - start
            wchar, (sent, retrans) = _wchar() - wchar, sent_since(tcp, tcp_bytes_sent())
            barrier.wait()  # measured: the receivers may let go of their connections
            if stats.bytes != model_bytes or stats.receivers != receivers:
                raise RuntimeError(f"version {version}: pushed {stats.bytes} bytes to {stats.receivers} "
                                   f"receivers, expected {model_bytes} to {receivers}")
            syncs.append({"seconds": seconds, "sender_bytes": sent, "sender_retrans_bytes": retrans,
                          "sender_wchar": wchar})
        results.put(("sender", syncs))
    except BaseException:
        barrier.abort()
        results.put(("error", f"{transport} sender: {traceback.format_exc()}"))
    finally:
        if sender is not None:
            sender.close()


def _transport_receiver(transport: str, rank: int, target, size_mb: int, repeats: int, secret: str,
                        barrier, results) -> None:
    """A receiving process: takes 1 + `repeats` versions, checks each, discards it. `target`: the
    ZMQ sender's address, or the collective group's spec."""
    torch.set_num_threads(1)
    layout = synthetic_layout(size_mb)
    expected = {name: shape for name, shape, _ in layout}
    receiver = None
    try:
        receiver = LoopbackReceiver(transport, rank, target, _TRANSPORT_TIMEOUT_S, secret)
        for version in range(repeats + 1):
            barrier.wait()
            checker = _Checker(layout, version)
            receiver.take(version, expected, checker.check, checker.complete)
            barrier.wait()  # the sender has measured
            receiver.release()
    except BaseException:
        barrier.abort()
        results.put(("error", f"{transport} receiver {rank}: {traceback.format_exc()}"))
    finally:
        if receiver is not None:
            receiver.close()


def _expect(results, kind: str, procs: list, deadline: float):
    """The next `kind` message from the children; raises on an error message, on a child that
    exited without reporting, or past `deadline`."""
    while time.monotonic() < deadline:
        try:
            message = results.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                try:  # its error message may still be in the pipe
                    message = results.get(timeout=5.0)
                except queue.Empty:
                    raise RuntimeError(f"{dead[0].name} exited with code {dead[0].exitcode} "
                                       "without reporting") from None
            else:
                continue
        if message[0] == "error":
            raise RuntimeError(message[1])
        if message[0] == kind:
            return message[1]
    raise RuntimeError(f"no {kind!r} from the benchmark's processes within the deadline")


def _run_transport(transport: str, receivers: int, size_mb: int, bucket_bytes: int, repeats: int) -> list[dict]:
    """One (transport, receivers) configuration in fresh processes: the sender's per-sync
    measurements, warm-up sync first."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    barrier = ctx.Barrier(1 + receivers, timeout=_TRANSPORT_TIMEOUT_S)
    secret = new_secret()
    deadline = time.monotonic() + _TRANSPORT_TIMEOUT_S * (repeats + 2)
    store, spec, procs = None, None, []
    try:
        if transport == "collective":
            store, spec = open_group(receivers, bucket_bytes, _TRANSPORT_TIMEOUT_S)
        procs.append(ctx.Process(target=_transport_sender, name=f"{transport}-sender",
                                 args=(transport, receivers, size_mb, bucket_bytes, repeats, secret, spec,
                                       barrier, results)))
        procs[0].start()
        target = _expect(results, "address", procs, deadline) if transport == "zmq" else spec
        for rank in range(1, receivers + 1):
            procs.append(ctx.Process(target=_transport_receiver, name=f"{transport}-receiver-{rank}",
                                     args=(transport, rank, target, size_mb, repeats, secret, barrier, results)))
            procs[-1].start()
        return _expect(results, "sender", procs, deadline)
    finally:
        barrier.abort()  # releases anyone still waiting (after a failure); harmless once all are through
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        del store


def _transport_row(transport: str, receivers: int, model_bytes: int, syncs: list[dict]) -> dict:
    timed = syncs[1:]  # the first is the warm-up
    seconds = statistics.median(s["seconds"] for s in timed)
    sent = round(statistics.median(s["sender_bytes"] for s in timed))
    return {
        "transport": transport, "receivers": receivers, "seconds": seconds,
        "sender_bytes": sent, "model_bytes": model_bytes, "sender_bytes_ratio": sent / model_bytes,
        "gbps_per_receiver": model_bytes / seconds / 1e9,
        "all_seconds": [s["seconds"] for s in timed], "all_sender_bytes": [s["sender_bytes"] for s in timed],
        "sender_retrans_bytes": round(statistics.median(s["sender_retrans_bytes"] for s in timed)),
        "sender_wchar": round(statistics.median(s["sender_wchar"] for s in timed)),
        "warmup_seconds": syncs[0]["seconds"],
    }


def run_transports(receivers: list[int], transports: list[str], size_mb: int = 256, bucket_mb: int = 64,
                   repeats: int = 3) -> dict:
    """For each transport and receiver count: a sender process and that many receiver processes,
    one untimed warm-up sync, then `repeats` timed ones; see the module docstring."""
    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown:
        raise ValueError(f"unknown transport(s) {unknown}; allowed: {', '.join(TRANSPORTS)}")
    model_bytes = sum(_nbytes(shape, dtype) for _, shape, dtype in synthetic_layout(size_mb))
    rows = []
    for transport in transports:
        for n in receivers:
            syncs = _run_transport(transport, n, size_mb, bucket_mb << 20, repeats)
            rows.append(_transport_row(transport, n, model_bytes, syncs))
            print(f"bench sync: {transport} to {n} receiver(s): {rows[-1]['seconds']:.3f} s/sync, "
                  f"sender sent {rows[-1]['sender_bytes_ratio']:.2f}x the model", flush=True)
    cpus = os.cpu_count()
    return {
        "rows": rows, "model_bytes": model_bytes, "size_mb": size_mb, "bucket_mb": bucket_mb, "repeats": repeats,
        "cpu_count": cpus,
        "note": (
            f"The sender and all receivers run on this one machine and share its {cpus} cores "
            "(os.cpu_count()), so `seconds` growing with receivers here is mostly the receivers competing "
            "for CPU and loopback bandwidth, not the transport. What the transport controls is "
            "sender_bytes: ZMQ sends a full copy to each receiver (about receivers x model_bytes), the "
            "collective chain (gloo) sends one copy and each receiver forwards it to the next (about "
            "1x model_bytes at any receiver count). sender_bytes sums TCP_INFO tcpi_bytes_sent over the "
            "sender process's TCP sockets, read before and after each sync inside the sender (it counts "
            "retransmitted bytes, also reported apart as sender_retrans_bytes); "
            "sender_wchar (/proc/self/io wchar) counts write()/writev() only, so it sees gloo's bytes but "
            "not libzmq's, which go through send()/sendmsg()."
        ),
    }
