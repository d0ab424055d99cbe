"""Device memory per GPU of a run, planned from its config and the model's ``config.json`` alone
(no weights are read, no GPU is needed): what ``agentgym-mega plan`` prints.

The model of memory
-------------------
Sizes are decimal bytes (1 GB = 1e9 B). A GPU of ``gpu_mem_gb`` GB offers that much less
``HEADROOM`` (5%) for the CUDA contexts of the processes sharing it (an engine worker and a trainer
rank, which hosts every role) and for allocator fragmentation. An "80 GB" H100 exposes 79.6 GiB = 85.5 GB,
so planning against 80 GB leaves a further ~5 GB unclaimed.

Trainer roles (actor, reference, critic: :func:`agentgym_mega.cluster.roles`), per GPU. Every
rank of a role holds one pipeline stage's layers, each cut over TP exactly as megatron-core's
``GPTModel`` cuts them: the embedding (vocabulary padded by :func:`gpt.padded_vocab_size`) on the
first stage, the final norm and the LM head (the critic's value head, never tied) on the last; a
tied LM head is the embedding itself at PP=1 and a copy on the last stage at PP>1. Middle stages
hold no more than the first, so the first and the last are planned.

* parameters: model dtype. A trainable role's parameters and gradients live in megatron's DDP
  buffers: each parameter starts at a multiple of 64 elements and each bucket (one per buffer as
  ``overlap_grad_reduce`` is off, plus one of its own for an embedding shared across stages) is
  padded to a multiple of lcm(dp, 128). The reference policy holds bare parameters.
* gradients: the same buffer in fp32 (``grad_reduce_in_fp32=True``).
* optimizer: Adam's two moments in fp32 and, for a bf16 model, fp32 main parameters, over this
  rank's 1/dp of the buffer (the distributed optimizer; its padding holds no state, so this is an
  upper bound by at most 64 elements per parameter tensor).
* activations, per micro-batch of T tokens (``trainer.max_tokens_per_gpu``, else
  ``micro_batch_size * rollout.max_model_len``, else the rank's whole slice of the batch), from
  Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"),
  re-derived for these models (SwiGLU, GQA, RMSNorm, no dropout) and for the fused attention
  megatron uses on GPU (Transformer Engine), which keeps no s x s score matrix. Per token and
  layer, in elements of the model dtype: 4h that TP replicates (both norms' inputs, the QKV and
  FC1 GEMM inputs; split over TP only with sequence parallelism) plus 2q + 2kv + 3f that TP splits
  (Q, K, V and the attention output; FC1's gate and up, SwiGLU's output), for hidden h, query width
  q, key/value width kv, MLP width f. ``selective`` recompute drops only the score matrices, which
  fused attention never stores, so it plans as ``none``; ``full`` keeps each layer's input (h,
  sequence-split with SP) plus one layer's activations recomputed in the backward pass. The
  1F1B schedule keeps pp - stage micro-batches in flight (pp on the first stage).
* log-prob peak (the actor's last stage): one micro-batch's logits over the TP shard of the
  padded vocabulary, the model-dtype output plus ``LOGIT_FP32_COPIES`` (2) fp32 tensors of its
  size alive at once (:func:`agentgym_mega.models.actor.token_logprobs_and_entropy`: the log p it
  keeps and their exponentials in the forward pass, log p and the softmax it recomputes from them
  in the backward pass; peak resident memory measured on CPU: 2.0 copies, bf16 or fp32 logits,
  with or without a temperature).
  The critic's value head has no such peak.

Engines (vLLM): each claims ``gpu_memory_utilization`` of every GPU it runs on. Inside that: the
weights (all parameters in the engine dtype / engine_tp), ``ENGINE_OVERHEAD`` (2 GB: the profiled
activation peak, the sampler, CUDA graphs) and the KV cache, the rest: 2 * layers * kv heads per
GPU * head_dim elements per token. An engine whose cache cannot hold one ``rollout.max_model_len``
sequence does not start. Asleep (vLLM sleep level 1) it keeps only the overhead.

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
  time. ``auto`` resolves to CUDA IPC when every engine shares the first trainer node, to the
  collective otherwise.
Colocated engines run on trainer GPUs 0 .. num_engines * engine_tp - 1; split placement plans
trainer GPUs and engine GPUs apart. A phase fits when its peak on every GPU is within the usable
memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from types import SimpleNamespace

from agentgym_mega.cluster import offload_on
from agentgym_mega.cluster import roles as run_roles
from agentgym_mega.config import ConfigError, apply_overrides, to_dict, validate
from agentgym_mega.errors import BadInput
from agentgym_mega.models import gpt, mapping
from agentgym_mega.weight_sync import SyncError, choose_transport
from agentgym_mega.weight_sync.factory import device_buckets

GB = 10**9
HEADROOM = 0.05
FP32 = 4
ADAM_MOMENTS = 2
LOGIT_FP32_COPIES = 2
ENGINE_OVERHEAD = 2 * GB
PARAM_ALIGN = 64  # megatron starts each parameter of a distributed-optimizer buffer at 64 elements
BUCKET_ALIGN = 128  # ... and pads each bucket to a multiple of lcm(dp, 128)
PHASES = ("startup", "rollout", "training", "weight_sync")
PHASE_NAMES = {"startup": "start-up / resume", "rollout": "rollout", "training": "training",
               "weight_sync": "weight sync"}
# The config.json keys the plan reads; any other key of model.architecture is only compared.
REQUIRED_KEYS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "vocab_size")
MAX_NEAREST = 3
UTILIZATIONS = (0.3, 0.4, 0.5)  # engine shares of a GPU the nearest-layout search tries


class LayoutError(BadInput):
    """A layout that megatron or vLLM refuses to build, whatever the memory."""


def _dtype_bytes(name: str) -> int:
    return 4 if name == "float32" else 2  # auto is bf16 on the GPUs a plan is for


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


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


@dataclasses.dataclass(frozen=True)
class Arch:
    """The shapes that decide memory, from an HF config dict."""

    name: str
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    max_positions: int | None

    @classmethod
    def of(cls, hf: dict) -> "Arch":
        """Refuses what the trainer's model builder refuses (same messages where it has them)."""
        missing = [k for k in REQUIRED_KEYS if k not in hf]
        if missing:
            raise BadInput(f"model architecture: {missing[0]} is missing; the planner reads "
                           f"{', '.join(REQUIRED_KEYS)}")
        view = SimpleNamespace(**hf)
        arch = gpt.check_architecture(view)
        geo = mapping.Geometry.of(view, padded_vocab=0)
        return cls(arch.hf_name, geo.hidden, geo.ffn, geo.layers, geo.heads, geo.kv_heads, geo.head_dim,
                   geo.vocab, bool(hf.get("tie_word_embeddings", False)), arch.qkv_bias,
                   hf.get("max_position_embeddings"))

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


def check_model_parallel(a: Arch, tp: int, pp: int) -> None:
    """The splits megatron refuses, as the trainer's model builder refuses them."""
    try:
        gpt.check_split(a.layers, a.kv_heads, a.ffn, tp, pp)
    except mapping.MappingError as exc:
        raise LayoutError(str(exc)) from None


def check_engine(a: Arch, engine_tp: int) -> None:
    """The engine tensor-parallel sizes vLLM refuses."""
    if a.heads % engine_tp:
        raise LayoutError(f"num_attention_heads={a.heads} is not divisible by rollout.engine_tp={engine_tp}: "
                          "vLLM splits attention heads evenly over an engine's GPUs")
    if engine_tp > a.kv_heads and engine_tp % a.kv_heads:
        raise LayoutError(f"rollout.engine_tp={engine_tp} is more than num_key_value_heads={a.kv_heads} "
                          "and not a multiple of it: vLLM replicates KV heads only in whole copies")


def layer_params(a: Arch, tp: int) -> list[int]:
    """One decoder layer's parameter sizes on a TP rank, in megatron's order."""
    qkv_rows = (a.heads + 2 * a.kv_heads) * a.head_dim // tp
    return [a.hidden,  # input norm (replicated)
            qkv_rows * a.hidden, *([qkv_rows] if a.qkv_bias else []),  # fused QKV (+ bias)
            a.hidden * a.q_width // tp,  # attention output projection
            a.hidden,  # pre-MLP norm
            2 * a.ffn // tp * a.hidden,  # FC1: gate and up
            a.hidden * a.ffn // tp]  # FC2


def stage_buckets(a: Arch, tp: int, pp: int, stage: int, value_head: bool = False) -> list[list[int]]:
    """A stage's parameter sizes on one TP rank, grouped as megatron's DDP buckets them: the
    layers (and embedding, norm, head), plus a bucket of its own for a tied embedding shared
    between the first and the last stage (PP>1)."""
    tied = a.tied and not value_head  # the critic's value head is never tied
    vocab_shard = gpt.padded_vocab_size(a.vocab, tp) // tp * a.hidden
    body = [n for _ in range(a.layers // pp) for n in layer_params(a, tp)]
    shared = []
    if stage == 0:
        (shared if tied and pp > 1 else body).append(vocab_shard)
    if stage == pp - 1:
        body.append(a.hidden)  # final norm
        if value_head:
            body += [a.hidden, 1]
        elif not tied:
            body.append(vocab_shard)
        elif pp > 1:
            shared.append(vocab_shard)  # the last stage's copy of the tied embedding
    return [b for b in (body, shared) if b]


def stage_params(a: Arch, tp: int, pp: int, stage: int, value_head: bool = False) -> int:
    """Parameters (elements) one rank of ``stage`` holds."""
    return sum(sum(b) for b in stage_buckets(a, tp, pp, stage, value_head))


def total_params(a: Arch) -> int:
    """The model's parameter count as its checkpoint has it (unpadded vocabulary, a tied
    embedding counted once)."""
    embeddings = (1 if a.tied else 2) * a.vocab * a.hidden
    return a.layers * sum(layer_params(a, 1)) + embeddings + a.hidden


def forward_flops_per_token(a: Arch, context: float) -> float:
    """FLOPs of one token's forward pass at ``context`` earlier tokens: 2 per weight of every
    matrix it multiplies (Q/K/V, attention output, MLP, the LM head; not the embedding lookup or
    the norms), plus the attention scores and their weighted sum over the context (2 x 2 x context
    x query width per layer). The backward pass costs twice the forward."""
    matrices = sum(layer_params(a, 1)) - 2 * a.hidden - ((a.heads + 2 * a.kv_heads) * a.head_dim if a.qkv_bias else 0)
    return 2 * (a.layers * matrices + a.vocab * a.hidden) + 4 * a.layers * context * a.q_width


def buffer_numel(buckets: list[list[int]], dp: int) -> int:
    """Elements of megatron's param/grad buffer for these buckets (distributed optimizer padding)."""
    align = math.lcm(dp, BUCKET_ALIGN)
    return sum(_round_up(sum(_round_up(n, PARAM_ALIGN) for n in b), align) for b in buckets)


def trainer_state(a: Arch, tp: int, pp: int, dp: int, stage: int, dtype_bytes: int, trainable: bool = True,
                  value_head: bool = False) -> dict:
    """Bytes of one rank's parameters, gradient buffer and optimizer state."""
    buckets = stage_buckets(a, tp, pp, stage, value_head)
    if not trainable:
        return {"params": sum(map(sum, buckets)) * dtype_bytes, "grads": 0, "optimizer": 0}
    numel = buffer_numel(buckets, dp)
    main_params = FP32 if dtype_bytes != FP32 else 0  # fp32 training steps the parameters themselves
    return {"params": numel * dtype_bytes, "grads": numel * FP32,
            "optimizer": numel // dp * (ADAM_MOMENTS * FP32 + main_params)}


def layer_activation_elements(a: Arch, tp: int, sequence_parallel: bool) -> float:
    """Elements one layer keeps per token for its backward pass (no recompute)."""
    replicated = 4 * a.hidden
    split = 2 * a.q_width + 2 * a.kv_width + 3 * a.ffn
    return replicated / (tp if sequence_parallel else 1) + split / tp


def activation_bytes(a: Arch, tp: int, pp: int, stage: int, sequence_parallel: bool, recompute: str,
                     tokens: int, dtype_bytes: int) -> int:
    """Activations a rank of ``stage`` holds at its peak, for micro-batches of ``tokens``."""
    seq_split = tp if sequence_parallel else 1
    layer = layer_activation_elements(a, tp, sequence_parallel)
    kept = a.hidden / seq_split if recompute == "full" else layer
    in_flight = pp - stage
    elements = in_flight * (a.layers // pp) * kept + (layer if recompute == "full" else 0)
    if stage == pp - 1:
        elements += 2 * a.hidden / seq_split  # final norm's and output layer's inputs
    return math.ceil(elements * tokens * dtype_bytes)


def logits_bytes(a: Arch, tp: int, tokens: int, dtype_bytes: int) -> int:
    """The log-prob peak: one micro-batch's logits on a TP rank and their fp32 copies."""
    return tokens * gpt.padded_vocab_size(a.vocab, tp) // tp * (dtype_bytes + LOGIT_FP32_COPIES * FP32)


def kv_bytes_per_token(a: Arch, engine_tp: int, dtype_bytes: int) -> int:
    """KV cache per token on one GPU of an engine (KV heads replicated when engine_tp > kv heads)."""
    return 2 * a.layers * max(1, a.kv_heads // engine_tp) * a.head_dim * dtype_bytes


def qkv_params(a: Arch, layers: int) -> int:
    """Fused Q/K/V weights (and biases) of ``layers`` whole layers."""
    rows = (a.heads + 2 * a.kv_heads) * a.head_dim
    return layers * rows * (a.hidden + (1 if a.qkv_bias else 0))


def sync_bytes(a: Arch, tp: int, pp: int, transport: str, dtype_bytes: int, bucket_bytes: int) -> int:
    """What exporting the weights adds on a sending rank, for a resolved `transport`: TP rank 0
    of the first stage over ZMQ, of every stage over the collective, every rank over CUDA IPC."""
    embedding = gpt.padded_vocab_size(a.vocab, tp) * a.hidden
    gather = (sum(layer_params(a, 1)) + embedding) if tp > 1 else 0
    held = a.vocab * a.hidden if tp > 1 or pp > 1 else 0  # the largest tensor, one at a time
    buckets = device_buckets(transport)[0] * bucket_bytes
    return (gather + held) * dtype_bytes + buckets


def engine_sync_bytes(a: Arch, transport: str, engine_dtype_bytes: int, bucket_bytes: int) -> int:
    """What receiving adds on an engine worker's GPU: the whole tensors of the layer being loaded
    (vLLM keeps a layer's until it is complete; a layer or the embedding, whichever is larger)
    and, over the collective, its two buckets. ZMQ bytes arrive in host memory."""
    if transport not in ("collective", "cuda_ipc"):
        return 0
    layer = max(sum(layer_params(a, 1)), a.vocab * a.hidden) * engine_dtype_bytes
    return layer + device_buckets(transport)[1] * bucket_bytes


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
    gpu_bytes: int
    nodes: int | None  # None: as many as the layout needs

    @classmethod
    def of(cls, cfg, gpus_per_node: int, gpu_mem_gb: float, nodes: int | None) -> "Layout":
        t, r = cfg.trainer, cfg.rollout
        return cls(
            tp=cfg.parallel.tp, pp=cfg.parallel.pp, world_size=cfg.parallel.world_size,
            sequence_parallel=cfg.parallel.sequence_parallel, recompute=cfg.parallel.recompute,
            engine_tp=r.engine_tp, num_engines=r.num_engines, placement=cfg.cluster.placement,
            offload=offload_on(cfg, gpus=True),  # planned for GPUs
            utilization=r.gpu_memory_utilization, max_model_len=r.max_model_len,
            micro_batch=(t.max_tokens_per_gpu, t.micro_batch_size, t.batch_size * r.n_per_task),
            dtype_bytes=_dtype_bytes(cfg.model.dtype), engine_dtype_bytes=_dtype_bytes(r.dtype),
            transport=cfg.weight_sync.transport, bucket_bytes=cfg.weight_sync.bucket_mb << 20,
            roles=run_roles(cfg), gpus_per_node=gpus_per_node,
            gpu_bytes=round(gpu_mem_gb * GB), nodes=nodes,
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
    def usable(self) -> int:
        return int(self.gpu_bytes * (1 - HEADROOM))

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
        for the nodes this layout puts the engine workers on: colocated engines fill trainer GPUs
        from 0, split engines the GPUs after the trainer's; the first trainer rank is on node 0."""
        first = 0 if self.placement == "colocated" else self.world_size
        nodes = sorted({f"node {gpu // self.gpus_per_node}" for gpu in range(first, first + self.engine_gpus)})
        try:
            return choose_transport(self.transport, "node 0", nodes, cuda=True)
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
                                                    lay.recompute, tokens, lay.dtype_bytes)
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
    if engine:
        held["engine"] = {k: engine[k] for k in ("weights", "kv_cache", "overhead")}
    return {"roles": held, "phases": phases}


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
        gpus.append({"name": "engine GPUs", "roles": {"engine": {k: engine[k] for k in ("weights", "kv_cache",
                                                                                          "overhead")}},
                     "phases": {"startup": engine["claim"], "rollout": engine["claim"],
                                "training": engine["overhead"],
                                "weight_sync": engine["overhead"] + engine["weights"] + engine_sync_bytes(
                                    a, lay.sync_transport(), lay.engine_dtype_bytes, lay.bucket_bytes)}})
    phases = {p: max(g["phases"][p] for g in gpus) for p in PHASES}
    peak_phase = max(PHASES, key=lambda p: phases[p])
    reason = None
    if engine["kv_cache"] < engine["kv_bytes_per_token"] * lay.max_model_len:
        reason = (f"the engines' KV cache ({engine['kv_cache'] / GB:.1f} GB per GPU: gpu_memory_utilization "
                  f"{lay.utilization} x {lay.gpu_bytes / GB:g} GB - weights {engine['weights'] / GB:.1f} GB - "
                  f"overhead {ENGINE_OVERHEAD / GB:.0f} GB) holds {engine['kv_tokens']} tokens, less than one "
                  f"rollout.max_model_len={lay.max_model_len} sequence: vLLM would not start")
    elif phases[peak_phase] > lay.usable:
        worst = max(gpus, key=lambda g: g["phases"][peak_phase])
        reason = (f"the {PHASE_NAMES[peak_phase]} phase needs {phases[peak_phase] / GB:.1f} GB on a GPU "
                  f"({worst['name']}), {(phases[peak_phase] - lay.usable) / GB:.1f} GB over the "
                  f"{lay.usable / GB:.1f} GB usable of {lay.gpu_bytes / GB:g} GB ({HEADROOM:.0%} headroom)")
    return {
        "model": {"architecture": a.name, "params": total_params(a)},
        "gpu": {"mem_bytes": lay.gpu_bytes, "usable_bytes": lay.usable, "headroom": HEADROOM,
                "per_node": lay.gpus_per_node, "nodes": lay.nodes_used, "gpus": lay.gpus_needed},
        "layout": {"placement": lay.placement, "offload": lay.offload, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp,
                   "world_size": lay.world_size, "sequence_parallel": lay.sequence_parallel,
                   "recompute": lay.recompute, "engine_tp": lay.engine_tp, "num_engines": lay.num_engines,
                   "micro_batch_tokens": tokens, "weight_sync": lay.sync_transport(),
                   "roles": list(lay.roles)},
        "engine": engine,
        "gpus": gpus,
        "phases": phases,
        "peak_bytes": phases[peak_phase],
        "peak_phase": peak_phase,
        "fits": reason is None,
        "reason": reason,
        "warnings": warnings,
    }


def plan(cfg, hf: dict, gpus_per_node: int = 8, gpu_mem_gb: float = 80.0, nodes: int | None = None,
         source: str = "") -> dict:
    """The plan of ``cfg`` on nodes of ``gpus_per_node`` GPUs of ``gpu_mem_gb`` GB (``nodes``:
    as many as the layout needs). One that does not fit has ``fits`` false, the ``reason`` and the
    ``nearest`` layouts that fit; a layout megatron or vLLM refuses raises BadInput naming why,
    with the nearest layouts."""
    if gpus_per_node < 1 or gpu_mem_gb <= 0 or (nodes is not None and nodes < 1):
        raise BadInput(f"gpus_per_node={gpus_per_node}, gpu_mem_gb={gpu_mem_gb}, nodes={nodes}: "
                       "each must be positive")
    a = Arch.of(hf)
    lay = Layout.of(cfg, gpus_per_node, gpu_mem_gb, nodes)
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


def nearest(cfg, a: Arch, lay: Layout, limit: int = MAX_NEAREST) -> list[dict]:
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
        f"GPUs: {_nodes(g['nodes'])} x {g['per_node']} of {g['mem_bytes'] / GB:g} GB, {g['usable_bytes'] / GB:.1f} GB "
        f"usable each ({g['headroom']:.0%} headroom); {g['gpus']} in use",
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
    peak = result["peak_bytes"]
    if result["fits"]:
        out += ["", f"fits: peak {_gb(peak)} GB per GPU ({PHASE_NAMES[result['peak_phase']]}), "
                    f"{_gb(g['usable_bytes'] - peak)} GB to spare"]
    else:
        out += ["", f"does not fit: {result['reason']}"]
    out += [f"warning: {w}" for w in result["warnings"]]
    return "\n".join(out)
