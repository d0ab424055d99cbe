"""What the memory plan reserves on each GPU beyond the tensors it counts, and what a run holds in
each node's host memory: pure functions of a layout's sizes, with their assumptions stated here.

GPU reserves (bytes, per GPU)
-----------------------------
The plan used to budget 95% of a decimal "80 GB": a lump for everything it did not count. It now
starts from the card's capacity as CUDA reports it (``total_memory``; an H100 80GB HBM3 reports
79.11 GiB, the "total capacity" of PyTorch's out-of-memory messages on that card) and subtracts
three reserves it can name, each of which grows with the layout (processes per GPU, communicators)
where the lump did not:

* ``cuda_context``: ``CUDA_CONTEXT`` (1 GiB) per process on the GPU: the trainer rank, plus the
  engine worker when colocated. A bare CUDA >= 11.7 context with lazy module loading is about
  400 MB (pytorch/pytorch#109888, #107667); the kernels of cuBLAS, NCCL, Transformer Engine and
  flash attention load into it as they are first used, and cuBLAS keeps a workspace per stream:
  1 GiB is the upper end of what such processes show on an H100 beside their tensors.
* ``nccl``: ``NCCL_COMMUNICATOR`` per NCCL communicator the GPU's processes hold. NCCL gives each
  channel a buffer of ``NCCL_BUFFSIZE`` (4 MiB, its default) per connection; a ring has two
  connections whatever the group's size, and on H100 NVLink NCCL opens up to 32 channels
  (NVIDIA/nccl#986: memory grows linearly with channels, a ring has 2 connections; #1685: 32
  channels per pair of H100s): 4 MiB x 32 x 2 = 256 MiB per communicator. torch creates a group's
  communicator at its first collective, so the groups counted are those a step uses with more
  than one member (:func:`trainer_communicators`, :func:`engine_communicators`).
* ``fragmentation``: a fraction of the capacity (``--fragmentation-reserve``, default
  ``FRAGMENTATION`` = 0.05, 3.96 GiB of an H100) for blocks the caching allocator holds but
  cannot hand out: every step releases the trainer's state for the engines and takes it back
  (models/offload.py), and vLLM's sleep and wake move its pools, so free memory comes back in
  pieces; PyTorch's out-of-memory messages report this as "reserved but unallocated".

Host memory (bytes, per node)
-----------------------------
Pinned blocks stay in torch's host caching allocator once freed (until ``torch._C._host_emptyCache``
of CUDA builds, which neither vLLM nor this repo calls), so what each process pins at any point
stays resident: the terms add up.

* ``sleep_backing``: with offload the engines sleep at vLLM's level 1 once, at start-up, while the
  trainer roles load (stack.py): vLLM 0.32's ``CuMemAllocator.sleep`` copies each engine worker's
  weights pool (its TP shard) into a ``torch.empty(..., pin_memory=True)`` tensor, and ``wake_up``
  only drops that tensor, which hands the pinned block back to torch's host cache, not to the OS:
  it stays resident for the engine's life, so the plan counts it in every phase. During steps the
  engines sleep at level 2 (trainer.py): the weights are discarded and only the model's buffers
  (rotary caches: tens of MB at most, pageable) are copied, which the plan leaves out. Without offload no
  engine ever sleeps at level 1 and the term is 0.
* ``trainer_offload``: with offload on (models/offload.py), each trainer rank copies to pinned
  host memory every trainable role's parameters, fp32 main parameters and Adam moments (its 1/dp
  share) and the reference policy's parameters; gradient buffers are discarded, not copied.
* ``sync_staging``: over ZMQ (tcp/ipc) the sender (trainer rank 0, node 0) packs two buckets of
  ``weight_sync.bucket_mb`` in host memory (one being filled while one is on the wire), and each
  engine worker receives into a bucket plus the whole tensors of the layer it is loading (vLLM
  keeps a layer's tensors until it is complete). The collective and CUDA IPC stage on the GPU.

Not counted: each process's own resident memory (Python, torch, vLLM, Ray), the environments'
servers, the page cache.
"""

from __future__ import annotations

# Nothing heavy is imported here: the CLI reads the defaults before it parses its arguments.
GIB = 1 << 30
MIB = 1 << 20
DEFAULT_GPU_GIB = 79.11  # what CUDA reports for an H100 80GB HBM3, the card the recipes are written for
DEFAULT_HOST_GB = 512
CUDA_CONTEXT = GIB
NCCL_BUFFSIZE = 4 * MIB
NCCL_CHANNELS = 32
NCCL_RING_CONNECTIONS = 2
NCCL_COMMUNICATOR = NCCL_BUFFSIZE * NCCL_CHANNELS * NCCL_RING_CONNECTIONS
FRAGMENTATION = 0.05
ZMQ_SENDER_BUCKETS = 2
ZMQ_RECEIVER_BUCKETS = 1


def card_gib() -> float | None:
    """The capacity of this machine's first GPU in GiB, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / GIB


def trainer_communicators(tp: int, pp: int, dp: int) -> dict[str, int]:
    """NCCL communicators a trainer rank holds once a step has run, by group, from the groups
    megatron-core 0.16's ``initialize_model_parallel`` builds: the world group (barriers); TP;
    the data-parallel group with context parallelism (the distributed optimizer's reduce-scatter
    and all-gather) and the one without (the trainer's metric all-reduce), apart even at CP=1;
    the model-parallel group (gradient norm, inf checks); with PP, one communicator per
    neighbouring stage (torch gives each send/recv pair its own) and the embedding group."""
    groups = {"world": tp * pp * dp > 1, "tp": tp > 1, "dp_cp": dp > 1, "dp": dp > 1,
              "model_parallel": tp * pp > 1, "pp_neighbours": 2 * (pp > 1), "embedding": pp > 1}
    return {name: int(n) for name, n in groups.items() if n}


def engine_communicators(engine_tp: int, transport: str, pp: int) -> dict[str, int]:
    """NCCL communicators an engine worker holds: with engine_tp > 1 vLLM's TP group twice (its
    GroupCoordinator keeps a torch NCCL group and a PyNcclCommunicator over the same ranks), and
    over the collective one weight-sync group per pipeline stage (each stage's sender and every
    engine worker)."""
    groups = {"tp": 2 * (engine_tp > 1), "weight_sync": pp if transport == "collective" else 0}
    return {name: n for name, n in groups.items() if n}


def gpu_reserves(capacity: int, processes: int, communicators: int, fragmentation: float) -> dict:
    """Bytes a GPU of ``capacity`` keeps out of the plan's reach."""
    return {"cuda_context": processes * CUDA_CONTEXT, "nccl": communicators * NCCL_COMMUNICATOR,
            "fragmentation": int(fragmentation * capacity)}


def zmq_staging(senders: int, receivers: int, bucket_bytes: int, layer_bytes: int) -> int:
    """Host bytes of a ZMQ sync on a node with ``senders`` senders and ``receivers`` engine workers,
    each loading a layer of ``layer_bytes`` at a time."""
    return senders * ZMQ_SENDER_BUCKETS * bucket_bytes + receivers * (ZMQ_RECEIVER_BUCKETS * bucket_bytes + layer_bytes)
