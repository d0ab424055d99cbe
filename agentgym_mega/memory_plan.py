"""Device memory per GPU of a run, planned from its config and the model's ``config.json`` alone
(no weights are read, no GPU is needed): what ``agentgym-mega plan`` prints.

The model of memory
-------------------
Sizes are decimal bytes (1 GB = 1e9 B). A GPU offers its capacity (``gpu_mem_gib``, binary, as
CUDA reports it) less the reserves of :mod:`agentgym_mega.memory_reserves`: a CUDA context per
process on it (a trainer rank, which hosts every role, and a colocated engine worker), the buffers
of the NCCL communicators those processes hold, and a fraction for allocator fragmentation. These
replace the 5% of a decimal 80 GB that the plan used to keep back as one lump: that lump sat on a
capacity 4.9 GB short of the card's (79.11 GiB = 84.9 GB) and stayed the same however many
processes and communicators shared the GPU.
Each node's host memory (the engines' start-up sleep backing, offloaded trainer state, sync
staging) is planned against ``host_mem_gb`` the same way.

What each trainer role and engine holds, and the formulas for it: :mod:`agentgym_mega.memory_formulas`.

Phases of the loop (:mod:`agentgym_mega.trainer`, :mod:`agentgym_mega.stack`), per GPU:
* start-up / resume: the trainer roles are built and a checkpoint (with its Adam moments) is
  loaded after the engines have started: with offload the engines sleep meanwhile (the stack puts
  them to sleep first), without it they hold their claim: every role's full state + the engines'
  overhead or claim.
* rollout: the engine claim + the roles' state, or nothing of it with offload (``cluster.offload``
  true, or auto when colocated), which releases every role to host memory while engines generate.
* training: engines asleep + every role's state + the actor's activations and log-prob peak (the
  roles run one at a time; the actor's working set is the largest).
* weight sync: engines with weights but no KV cache + the actor's parameters (with offload the
  rest is released; without, everything stays) + on a sending rank what the export holds: at
  TP>1 the gather buffers (one layer and the embedding, whole) and the largest tensor. ZMQ sends
  from TP rank 0 of the first stage, out of host memory. The collective sends from TP rank 0 of
  every stage through two buckets on its GPU, and each engine worker receives into two buckets
  plus the whole tensors of the layer it is loading. CUDA IPC sends from every rank that has
  engine workers on its GPU, through a ring of 3 buckets there, and the worker loads a layer at a
  time. The transport is resolved by the trainer's own rule (weight_sync.choose_transport):
  ``auto`` is CUDA IPC when every engine worker shares a trainer rank's GPU (colocated, any
  number of nodes), the collective otherwise.
Colocated engines run on trainer GPUs 0 .. num_engines * engine_tp - 1; split placement plans
trainer GPUs and engine GPUs apart (engines on the GPUs after the trainer's). A layout fits when
every phase's peak on every GPU is within that GPU's capacity less its reserves, and every node's
host memory within ``host_mem_gb``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os

from agentgym_mega import memory_reserves as mr
from agentgym_mega.cluster import offload_on
from agentgym_mega.cluster import roles as run_roles
from agentgym_mega.config import Config, ConfigError, apply_overrides, to_dict, validate
from agentgym_mega.errors import BadInput
from agentgym_mega.memory_formulas import (
    ENGINE_OVERHEAD,
    GB,
    Arch,
    LayoutError,
    activation_bytes,
    check_engine,
    check_model_parallel,
    engine_sync_bytes,
    kv_bytes_per_token,
    loading_bytes,
    logits_bytes,
    sync_bytes,
    total_params,
    trainer_state,
)
from agentgym_mega.weight_sync import SyncError, choose_transport, planned_layout

PHASES = ("startup", "rollout", "training", "weight_sync")
PHASE_NAMES = {"startup": "start-up / resume", "rollout": "rollout", "training": "training",
               "weight_sync": "weight sync"}
MAX_NEAREST = 3
UTILIZATIONS = (0.3, 0.4, 0.5)  # engine shares of a GPU the nearest-layout search tries


def dtype_bytes(name: str) -> int:
    """Bytes per element of a model dtype as a plan takes it."""
    return 4 if name == "float32" else 2  # auto is bf16 on the GPUs a plan is for


# -- the model ---------------------------------------------------------------------------------

def read_architecture(model) -> tuple[dict, str]:
    """The HF config facts of ``model`` (the config's model section) and where they came from:
    ``model.path``'s config.json when it exists (checked against ``model.architecture`` when both
    are given), else ``model.architecture``."""
    path = os.path.join(model.path, "config.json") if model.path else ""
    if path and os.path.isfile(path):
        with open(path) as f:
            hf = json.load(f)
        for key, value in (model.architecture or {}).items():
            if key not in hf or hf[key] != value:
                found = repr(hf[key]) if key in hf else "no such key"
                raise ConfigError(f"model.architecture.{key}={value!r} disagrees with {path} ({found}); "
                                  "make it match the checkpoint or remove model.architecture")
        return hf, path
    if model.architecture is None:
        raise BadInput(f"model.path={model.path!r} has no config.json and model.architecture is not set: "
                       "the planner needs one of them (configs/models/*.yaml set both)")
    return dict(model.architecture), "model.architecture"


# -- the layout and its plan -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Layout:
    """What the plan depends on, from a config and the GPUs."""

    tp: int
    pp: int
    world_size: int
    sequence_parallel: bool
    recompute: str
    engine_tp: int
    num_engines: int
    placement: str
    offload: bool
    utilization: float
    max_model_len: int
    micro_batch: tuple  # (trainer.max_tokens_per_gpu, trainer.micro_batch_size, sequences per batch)
    dtype_bytes: int
    engine_dtype_bytes: int
    transport: str
    bucket_bytes: int
    roles: tuple
    gpus_per_node: int
    gpu_bytes: int  # the card's capacity
    nodes: int | None  # None: as many as the layout needs
    fragmentation: float = mr.FRAGMENTATION  # share of gpu_bytes reserved for allocator fragmentation
    host_bytes: int = mr.DEFAULT_HOST_GB * GB  # host memory of a node
    fused: bool = True  # megatron's fused kernels, as the trainer builds them on GPU (gpt.transformer_config)

    @classmethod
    def of(cls, cfg: Config, gpus_per_node: int, gpu_bytes: int, nodes: int | None,
           fragmentation: float = mr.FRAGMENTATION, host_bytes: int = mr.DEFAULT_HOST_GB * GB) -> "Layout":
        t, r = cfg.trainer, cfg.rollout
        return cls(
            tp=cfg.parallel.tp, pp=cfg.parallel.pp, world_size=cfg.parallel.world_size,
            sequence_parallel=cfg.parallel.sequence_parallel, recompute=cfg.parallel.recompute,
            engine_tp=r.engine_tp, num_engines=r.num_engines, placement=cfg.cluster.placement,
            offload=offload_on(cfg, gpus=True),  # planned for GPUs
            utilization=r.gpu_memory_utilization, max_model_len=r.max_model_len,
            micro_batch=(t.max_tokens_per_gpu, t.micro_batch_size, t.batch_size * r.n_per_task),
            dtype_bytes=dtype_bytes(cfg.model.dtype), engine_dtype_bytes=dtype_bytes(r.dtype),
            transport=cfg.weight_sync.transport, bucket_bytes=cfg.weight_sync.bucket_mb << 20,
            roles=run_roles(cfg), gpus_per_node=gpus_per_node,
            gpu_bytes=gpu_bytes, nodes=nodes, fragmentation=fragmentation, host_bytes=host_bytes,
        )

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def engine_gpus(self) -> int:
        return self.num_engines * self.engine_tp

    @property
    def gpus_needed(self) -> int:
        return self.world_size + (self.engine_gpus if self.placement == "split" else 0)

    @property
    def nodes_used(self) -> int:
        return self.nodes or -(-self.gpus_needed // self.gpus_per_node)

    @property
    def engine_first_gpu(self) -> int:
        """Colocated engines fill trainer GPUs from 0, split engines the GPUs after the trainer's."""
        return 0 if self.placement == "colocated" else self.world_size

    def tokens(self) -> tuple[int, str | None]:
        """Tokens of one micro-batch, and a warning when that is a rank's whole slice."""
        budget, size, sequences = self.micro_batch
        if budget:
            return budget, None
        if size:
            return size * self.max_model_len, None
        share = sequences // self.dp
        return share * self.max_model_len, (
            f"trainer.micro_batch_size and trainer.max_tokens_per_gpu are null: a micro-batch is a rank's "
            f"whole slice of the batch ({share} sequences of up to {self.max_model_len} tokens); set one")

    def sync_transport(self) -> str:
        """weight_sync.transport resolved by the trainer's own rule (weight_sync.choose_transport)
        for this layout; one it cannot carry (e.g. a collective that would hold a GPU twice) is
        a LayoutError."""
        return _resolved(self.transport, self.world_size, self.pp, self.num_engines, self.engine_tp,
                         self.placement == "colocated", self.gpus_per_node)


@functools.lru_cache(maxsize=4096)
def _resolved(transport: str, world_size: int, pp: int, num_engines: int, engine_tp: int, colocated: bool,
              gpus_per_node: int) -> str:
    """Layout.sync_transport, once per layout: the nearest-fit search asks for thousands, each
    several times, and a layout of 512 GPUs lists every member."""
    layout = planned_layout(world_size, pp, num_engines, engine_tp, colocated, gpus_per_node)
    try:
        return choose_transport(transport, layout, cuda=True)
    except SyncError as exc:
        raise LayoutError(str(exc)) from None


def _engine(a: Arch, lay: Layout) -> dict:
    claim = int(lay.utilization * lay.gpu_bytes)
    weights = -(-total_params(a) * lay.engine_dtype_bytes // lay.engine_tp)
    per_token = kv_bytes_per_token(a, lay.engine_tp, lay.engine_dtype_bytes)
    kv = max(0, claim - weights - ENGINE_OVERHEAD)
    return {"claim": claim, "weights": weights, "overhead": ENGINE_OVERHEAD, "kv_cache": kv,
            "kv_bytes_per_token": per_token, "kv_tokens": kv // per_token}


def _roles_at(a: Arch, lay: Layout, stage: int, tokens: int) -> dict:
    """Each trainer role's bytes on one rank of ``stage``."""
    out = {}
    for role in lay.roles:
        state = trainer_state(a, lay.tp, lay.pp, lay.dp, stage, lay.dtype_bytes, trainable=role != "ref",
                              value_head=role == "critic")
        if role == "actor":
            state["activations"] = activation_bytes(a, lay.tp, lay.pp, stage, lay.sequence_parallel,
                                                    lay.recompute, tokens, lay.dtype_bytes, lay.fused)
            state["logprob_peak"] = logits_bytes(a, lay.tp, tokens, lay.dtype_bytes) if stage == lay.pp - 1 else 0
        out[role] = state
    return out


def _trainer_gpu(a: Arch, lay: Layout, stage: int, tokens: int, engine: dict | None) -> dict:
    """One trainer GPU of ``stage`` (with a colocated engine or not): its roles and phase peaks."""
    held = _roles_at(a, lay, stage, tokens)
    state = sum(r["params"] + r["grads"] + r["optimizer"] for r in held.values())
    actor = held["actor"]
    awake, asleep = (engine["claim"], engine["overhead"]) if engine else (0, 0)
    transport = lay.sync_transport()
    sends = stage == 0 or transport in ("collective", "cuda_ipc")  # see sync_bytes
    sync_extra = sync_bytes(a, lay.tp, lay.pp, transport, lay.dtype_bytes, lay.bucket_bytes) if sends else 0
    receiving = engine_sync_bytes(a, transport, lay.engine_dtype_bytes, lay.bucket_bytes) if engine else 0
    phases = {
        "startup": (asleep if lay.offload else awake) + state,
        "rollout": awake + (0 if lay.offload else state),
        "training": asleep + state + actor["activations"] + actor["logprob_peak"],
        "weight_sync": asleep + (engine["weights"] if engine else 0) + (actor["params"] if lay.offload else state)
        + sync_extra + receiving,
    }
    communicators = mr.trainer_communicators(lay.tp, lay.pp, lay.dp)
    if sends and transport == "collective":
        communicators["weight_sync"] = 1
    if engine:
        held["engine"] = {k: engine[k] for k in ("weights", "kv_cache", "overhead")}
        engine_groups = mr.engine_communicators(lay.engine_tp, transport, lay.pp)
        communicators |= {f"engine_{k}": n for k, n in engine_groups.items()}
    return {"roles": held, "phases": phases, **_reserved(lay, 1 + bool(engine), communicators)}


def _reserved(lay: Layout, processes: int, communicators: dict) -> dict:
    """A GPU's communicators, reserves and what remains for the plan's tensors."""
    reserves = mr.gpu_reserves(lay.gpu_bytes, processes, sum(communicators.values()), lay.fragmentation)
    return {"communicators": communicators, "reserves": reserves,
            "usable_bytes": lay.gpu_bytes - sum(reserves.values())}


def _engine_gpu(a: Arch, lay: Layout, engine: dict) -> dict:
    """A GPU of a split engine: its claim while generating, asleep otherwise, and the sync."""
    transport = lay.sync_transport()
    return {"name": "engine GPUs", "roles": {"engine": {k: engine[k] for k in ("weights", "kv_cache", "overhead")}},
            "phases": {"startup": engine["claim"], "rollout": engine["claim"], "training": engine["overhead"],
                       "weight_sync": engine["overhead"] + engine["weights"]
                       + engine_sync_bytes(a, transport, lay.engine_dtype_bytes, lay.bucket_bytes)},
            **_reserved(lay, 1, mr.engine_communicators(lay.engine_tp, transport, lay.pp))}


def _host(a: Arch, lay: Layout, tokens: int, engine: dict) -> dict:
    """Each node's host memory (memory_reserves): the worst node's bytes by term, and every node's."""
    held = {stage: _roles_at(a, lay, stage, tokens) for stage in {0, lay.pp - 1}}
    offloaded = {stage: sum(r["params"] + r["optimizer"] for r in roles.values()) if lay.offload else 0
                 for stage, roles in held.items()}
    zmq = lay.sync_transport() in ("tcp", "ipc")
    nodes = []
    for node in range(lay.nodes_used):
        gpus = range(node * lay.gpus_per_node, (node + 1) * lay.gpus_per_node)
        stages = [min(gpu // (lay.tp * lay.dp), lay.pp - 1) for gpu in gpus if gpu < lay.world_size]
        workers = sum(lay.engine_first_gpu <= gpu < lay.engine_first_gpu + lay.engine_gpus for gpu in gpus)
        nodes.append({
            "sleep_backing": workers * engine["weights"] if lay.offload else 0,
            "trainer_offload": sum(offloaded[0 if s < lay.pp - 1 else s] for s in stages),
            "sync_staging": mr.zmq_staging(int(node == 0), workers, lay.bucket_bytes,
                                           loading_bytes(a, lay.engine_dtype_bytes)) if zmq else 0,
        })
    totals = [sum(n.values()) for n in nodes]
    worst = max(range(len(nodes)), key=totals.__getitem__)
    return {"limit_bytes": lay.host_bytes, "worst_node": worst, "breakdown_bytes": nodes[worst],
            "per_node_bytes": totals}


def _stages(pp: int) -> list[tuple[int, str]]:
    if pp == 1:
        return [(0, "every trainer GPU")]
    return [(0, f"stage 1 of {pp}"), (pp - 1, f"stage {pp} of {pp}")]


def plan_layout(a: Arch, lay: Layout) -> dict:
    """The plan of one layout (bytes); raises LayoutError for one that cannot be built."""
    check_model_parallel(a, lay.tp, lay.pp)
    check_engine(a, lay.engine_tp)
    if lay.nodes is not None and lay.nodes * lay.gpus_per_node < lay.gpus_needed:
        raise LayoutError(f"the layout needs {lay.gpus_needed} GPUs ({lay.world_size} trainer ranks"
                          + (f" + {lay.engine_gpus} engine GPUs" if lay.placement == "split" else "")
                          + f"); {lay.nodes} node(s) x {lay.gpus_per_node} GPUs have {lay.nodes * lay.gpus_per_node}")
    if a.max_positions and lay.max_model_len > a.max_positions:
        raise LayoutError(f"rollout.max_model_len={lay.max_model_len} is more than the model's "
                          f"max_position_embeddings={a.max_positions}: vLLM refuses it")
    tokens, warning = lay.tokens()
    warnings = [warning] if warning else []
    if lay.tp > lay.gpus_per_node or lay.engine_tp > lay.gpus_per_node:
        warnings.append(f"tensor parallelism wider than a node ({lay.gpus_per_node} GPUs) runs over the "
                        "network: slow")
    engine = _engine(a, lay)
    gpus = []
    for stage, name in _stages(lay.pp):
        # colocated engines sit on trainer GPUs 0 .. engine_gpus - 1; megatron orders ranks TP
        # first, then DP, then PP, so stage s starts at GPU s * tp * dp
        has_engine = lay.placement == "colocated" and stage * lay.tp * lay.dp < lay.engine_gpus
        gpus.append({"name": name, **_trainer_gpu(a, lay, stage, tokens, engine if has_engine else None)})
    if lay.placement == "split":
        gpus.append(_engine_gpu(a, lay, engine))
    phases = {p: max(g["phases"][p] for g in gpus) for p in PHASES}
    peak_phase = max(PHASES, key=lambda p: phases[p])
    tightest = min(gpus, key=lambda g: g["usable_bytes"])
    host = _host(a, lay, tokens, engine)
    reason = _misfit(lay, engine, gpus, host)
    return {
        "model": {"architecture": a.name, "params": total_params(a)},
        "gpu": {"mem_gib": round(lay.gpu_bytes / mr.GIB, 4), "mem_bytes": lay.gpu_bytes,
                "usable_bytes": tightest["usable_bytes"], "fragmentation_reserve": lay.fragmentation,
                "per_node": lay.gpus_per_node, "nodes": lay.nodes_used, "gpus": lay.gpus_needed},
        "layout": {"placement": lay.placement, "offload": lay.offload, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp,
                   "world_size": lay.world_size, "sequence_parallel": lay.sequence_parallel,
                   "recompute": lay.recompute, "fused": lay.fused, "engine_tp": lay.engine_tp,
                   "num_engines": lay.num_engines, "micro_batch_tokens": tokens, "weight_sync": lay.sync_transport(),
                   "roles": list(lay.roles)},
        "engine": engine,
        "gpus": gpus,
        "reserves_gb": {k: v / GB for k, v in tightest["reserves"].items()},
        "phases": phases,
        "peak_bytes": phases[peak_phase],
        "peak_phase": peak_phase,
        "host_gb_per_node": max(host["per_node_bytes"]) / GB,
        "host": host,
        "fits": reason is None,
        "reason": reason,
        "warnings": warnings,
    }


def _misfit(lay: Layout, engine: dict, gpus: list[dict], host: dict) -> str | None:
    """Why the layout does not fit (None when it does): an engine without room for a sequence,
    the phase most over its GPU's usable memory, or the node most over its host memory."""
    if engine["kv_cache"] < engine["kv_bytes_per_token"] * lay.max_model_len:
        return (f"the engines' KV cache ({engine['kv_cache'] / GB:.1f} GB per GPU: gpu_memory_utilization "
                f"{lay.utilization} x {lay.gpu_bytes / mr.GIB:g} GiB - weights {engine['weights'] / GB:.1f} GB - "
                f"overhead {ENGINE_OVERHEAD / GB:.0f} GB) holds {engine['kv_tokens']} tokens, less than one "
                f"rollout.max_model_len={lay.max_model_len} sequence: vLLM would not start")
    over, gpu, phase = max(((g["phases"][p] - g["usable_bytes"], g, p) for g in gpus for p in PHASES),
                           key=lambda t: t[0])
    if over > 0:
        r = gpu["reserves"]
        return (f"the {PHASE_NAMES[phase]} phase needs {gpu['phases'][phase] / GB:.1f} GB on a GPU ({gpu['name']}), "
                f"{over / GB:.1f} GB over the {gpu['usable_bytes'] / GB:.1f} GB usable of "
                f"{lay.gpu_bytes / mr.GIB:g} GiB = {lay.gpu_bytes / GB:.1f} GB (reserved: CUDA contexts "
                f"{r['cuda_context'] / GB:.1f}, NCCL {r['nccl'] / GB:.1f}, "
                f"fragmentation {r['fragmentation'] / GB:.1f} GB)")
    node = host["worst_node"]
    if host["per_node_bytes"][node] > lay.host_bytes:
        terms = ", ".join(f"{k.replace('_', ' ')} {v / GB:.1f}" for k, v in host["breakdown_bytes"].items())
        return (f"node {node}'s host memory needs {host['per_node_bytes'][node] / GB:.1f} GB ({terms} GB), "
                f"{(host['per_node_bytes'][node] - lay.host_bytes) / GB:.1f} GB over --host-mem-gb "
                f"{lay.host_bytes / GB:g}")
    return None


def plan(cfg: Config, hf: dict, gpus_per_node: int = 8, gpu_mem_gib: float = mr.DEFAULT_GPU_GIB,
         nodes: int | None = None, source: str = "", fragmentation: float = mr.FRAGMENTATION,
         host_mem_gb: float = mr.DEFAULT_HOST_GB) -> dict:
    """The plan of ``cfg`` on nodes of ``gpus_per_node`` GPUs of ``gpu_mem_gib`` GiB and
    ``host_mem_gb`` GB of host memory (``nodes``: as many as the layout needs), keeping
    ``fragmentation`` of each GPU for the allocator. One that does not fit has ``fits`` false,
    the ``reason`` and the ``nearest`` layouts that fit; a layout megatron or vLLM refuses raises
    BadInput naming why, with the nearest layouts."""
    if (gpus_per_node < 1 or gpu_mem_gib <= 0 or host_mem_gb <= 0 or (nodes is not None and nodes < 1)
            or not 0 < fragmentation < 1):
        raise BadInput(f"gpus_per_node={gpus_per_node}, gpu_mem_gib={gpu_mem_gib}, host_mem_gb={host_mem_gb}, "
                       f"nodes={nodes}: each must be positive; fragmentation={fragmentation}: in (0, 1)")
    a = Arch.of(hf)
    lay = Layout.of(cfg, gpus_per_node, round(gpu_mem_gib * mr.GIB), nodes, fragmentation, round(host_mem_gb * GB))
    try:
        result = plan_layout(a, lay)
    except LayoutError as exc:
        raise BadInput(refusal(str(exc), nearest(cfg, a, lay))) from None
    result["model"]["source"] = source
    result["nearest"] = [] if result["fits"] else nearest(cfg, a, lay)
    return result


# -- the nearest layouts that fit --------------------------------------------------------------

def _candidates(a: Arch, lay: Layout):
    """Layouts around ``lay``: TP in powers of two up to a node, PP dividing the layers, node
    counts up to four times as many (8 at least), engine TP, recompute, a smaller engine share of
    the GPU (``UTILIZATIONS`` below the given one), and micro-batches of one sequence's worth of
    tokens (``trainer.max_tokens_per_gpu = rollout.max_model_len``, the least a micro-batch can
    hold). Colocated engines keep covering the trainer GPUs if they did; otherwise engines keep
    at most the GPUs they had (split placement gives the rest of the nodes to the trainer)."""
    powers = [2**i for i in range(int(math.log2(lay.gpus_per_node)) + 1)]
    tps = [t for t in powers if a.kv_heads % t == 0 and a.ffn % t == 0]
    etps = [t for t in powers if a.heads % t == 0 and (t <= a.kv_heads or t % a.kv_heads == 0)]
    pps = [p for p in range(1, a.layers + 1) if a.layers % p == 0]
    covering = lay.placement == "colocated" and lay.engine_gpus == lay.world_size
    smallest = (lay.max_model_len, None, lay.micro_batch[2])
    micro_batches = [lay.micro_batch] + ([smallest] if lay.tokens()[0] > lay.max_model_len else [])
    utilizations = [lay.utilization] + [u for u in UTILIZATIONS if u < lay.utilization]
    for nodes, tp, pp, etp, recompute, micro_batch, utilization in itertools.product(
            range(1, max(8, 4 * lay.nodes_used) + 1), tps, pps, etps, ("none", "selective", "full"),
            micro_batches, utilizations):
        gpus = nodes * lay.gpus_per_node
        split = lay.placement == "split"
        engines = gpus // etp if covering else max(1, lay.engine_gpus // etp)
        world = gpus - engines * etp if split else gpus
        if (world < 1 or world % (tp * pp) or (covering and gpus % etp)
                or (not split and engines * etp > world)):
            continue
        yield dataclasses.replace(lay, tp=tp, pp=pp, world_size=world, engine_tp=etp, num_engines=engines,
                                  recompute=recompute, sequence_parallel=lay.sequence_parallel and tp > 1,
                                  micro_batch=micro_batch, utilization=utilization, nodes=nodes)


def _overrides(lay: Layout, new: Layout) -> list[str]:
    keys = (("parallel.tp", "tp"), ("parallel.pp", "pp"), ("parallel.world_size", "world_size"),
            ("parallel.sequence_parallel", "sequence_parallel"), ("parallel.recompute", "recompute"),
            ("rollout.engine_tp", "engine_tp"), ("rollout.num_engines", "num_engines"),
            ("rollout.gpu_memory_utilization", "utilization"))
    changes = [f"{key}={str(getattr(new, field)).lower()}" for key, field in keys
               if getattr(new, field) != getattr(lay, field)]
    for index, key in enumerate(("trainer.max_tokens_per_gpu", "trainer.micro_batch_size")):
        if new.micro_batch[index] != lay.micro_batch[index]:
            value = new.micro_batch[index]
            changes.append(f"{key}={'null' if value is None else value}")
    return changes


def nearest(cfg: Config, a: Arch, lay: Layout, limit: int = MAX_NEAREST) -> list[dict]:
    """Up to ``limit`` layouts that fit and that the config accepts, fewest changed settings first
    (then fewest nodes, then lowest peak), each as the overrides that make it; a layout that only
    adds changes to one already found is left out."""
    by_changes: dict[int, list] = {}
    for new in _candidates(a, lay):
        changes = _overrides(lay, new)
        if changes:
            by_changes.setdefault(len(changes), []).append((new, changes))
    base = to_dict(cfg)
    base["parallel"]["dp"] = None  # derived again from the new sizes
    found = []
    for count in sorted(by_changes):
        for new, changes in by_changes[count]:
            try:
                result = plan_layout(a, new)
            except LayoutError:
                continue
            if not result["fits"] or any(set(f["overrides"]) < set(changes) for f in found):
                continue
            try:
                validate(apply_overrides(base, changes))
            except ConfigError:  # e.g. the mini-batch no longer splits over the new dp
                continue
            found.append({"overrides": changes, "nodes": new.nodes_used, "peak_bytes": result["peak_bytes"],
                          "peak_phase": result["peak_phase"]})
        if len(found) >= limit:
            break
    found.sort(key=lambda f: (len(f["overrides"]), f["nodes"], f["peak_bytes"]))
    return found[:limit]


def refusal(reason: str, fits: list[dict]) -> str:
    """The message for a layout that does not fit: the reason and the nearest ones that do."""
    if not fits:
        return f"{reason}\nno layout within the searched node counts fits: a larger GPU or a smaller model"
    lines = [f"  {' '.join(f['overrides'])}    # {_nodes(f['nodes'])}, peak {f['peak_bytes'] / GB:.1f} GB "
             f"({PHASE_NAMES[f['peak_phase']]})" for f in fits]
    return (f"{reason}\nnearest layouts that fit (overrides to paste; pass --nodes too where it changes):\n"
            + "\n".join(lines))


# -- output ------------------------------------------------------------------------------------

_ROWS = (("params", "parameters"), ("grads", "gradients (fp32)"), ("optimizer", "optimizer (Adam, /dp)"),
         ("activations", "activations"), ("logprob_peak", "log-prob peak"), ("weights", "vLLM weights"),
         ("kv_cache", "vLLM KV cache"), ("overhead", "vLLM overhead"))


def _gb(n: int) -> str:
    return f"{n / GB:.2f}"


def _nodes(n: int) -> str:
    return f"{n} node" + ("" if n == 1 else "s")


def render(result: dict) -> str:
    """The plan as tables, in GB."""
    m, g, lay, e = result["model"], result["gpu"], result["layout"], result["engine"]
    out = [
        f"model: {m['architecture']}, {m['params'] / 1e9:.2f} B parameters ({m.get('source') or 'given'})",
        f"GPUs: {_nodes(g['nodes'])} x {g['per_node']} of {g['mem_gib']:g} GiB = {_gb(g['mem_bytes'])} GB; "
        f"{g['gpus']} in use; {_gb(g['usable_bytes'])} GB usable on the tightest, reserved there: CUDA contexts "
        f"{result['reserves_gb']['cuda_context']:.2f}, NCCL {result['reserves_gb']['nccl']:.2f}, fragmentation "
        f"{result['reserves_gb']['fragmentation']:.2f} ({g['fragmentation_reserve']:.0%})",
        f"trainer: {lay['placement']}, offload {'on' if lay['offload'] else 'off'}, tp={lay['tp']} pp={lay['pp']} "
        f"dp={lay['dp']} ({lay['world_size']} ranks), sequence parallel {'on' if lay['sequence_parallel'] else 'off'}, "
        f"recompute {lay['recompute']}, {lay['micro_batch_tokens']} tokens per micro-batch; roles: "
        f"{', '.join(lay['roles'])}",
        f"engines: {lay['num_engines']} x tp{lay['engine_tp']}, {_gb(e['claim'])} GB per GPU: weights "
        f"{_gb(e['weights'])}, KV cache {_gb(e['kv_cache'])} ({e['kv_tokens']:,} tokens at "
        f"{e['kv_bytes_per_token']:,} B), overhead {_gb(e['overhead'])}; weight sync by {lay['weight_sync']}",
    ]
    for gpu in result["gpus"]:
        columns = list(gpu["roles"])
        out += ["", f"{gpu['name'] + ', GB':<26}" + "".join(f"{c:>10}" for c in columns)]
        for key, label in _ROWS:
            values = [gpu["roles"][c].get(key) for c in columns]
            if any(values):
                out.append(f"  {label:<24}" + "".join(f"{_gb(v) if v else '-':>10}" for v in values))
    width = max(len(gpu["name"]) for gpu in result["gpus"]) + 2
    out += ["", f"{'phase peak, GB':<26}" + "".join(f"{gpu['name']:>{width}}" for gpu in result["gpus"])]
    for phase in PHASES:
        out.append(f"  {PHASE_NAMES[phase]:<24}" + "".join(f"{_gb(gpu['phases'][phase]):>{width}}"
                                                           for gpu in result["gpus"]))
    out.append(f"  {'usable (less reserves)':<24}" + "".join(f"{_gb(gpu['usable_bytes']):>{width}}"
                                                             for gpu in result["gpus"]))
    host = result["host"]
    out += ["", f"host memory, node {host['worst_node']} (the fullest), GB: "
            + ", ".join(f"{k.replace('_', ' ')} {_gb(v)}" for k, v in host["breakdown_bytes"].items())
            + f"; {result['host_gb_per_node']:.2f} of {_gb(host['limit_bytes'])}"]
    peak = result["peak_bytes"]
    if result["fits"]:
        spare = min(gpu["usable_bytes"] - max(gpu["phases"].values()) for gpu in result["gpus"])
        out += ["", f"fits: peak {_gb(peak)} GB per GPU ({PHASE_NAMES[result['peak_phase']]}), "
                    f"{_gb(spare)} GB to spare on the fullest"]
    else:
        out += ["", f"does not fit: {result['reason']}"]
    out += [f"warning: {w}" for w in result["warnings"]]
    return "\n".join(out)
