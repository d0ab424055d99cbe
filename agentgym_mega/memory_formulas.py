"""The formulas of agentgym_mega.memory_plan: bytes per GPU of each trainer role and of an engine,
from a model's shapes (:class:`Arch`) and one layout's sizes, with no I/O and no layout search.
Sizes are decimal bytes (1 GB = 1e9 B).

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
  FC1 GEMM inputs; split over TP only with sequence parallelism) plus 2q + 2kv + the MLP's that TP
  splits (Q, K, V and the attention output), for hidden h, query width q, key/value width kv, MLP
  width f. The MLP keeps what autograd saves in megatron-core 0.16's ``MLP.forward``: with
  ``bias_activation_fusion`` (on where megatron runs on GPU) ``bias_swiglu_impl`` saves FC1's
  output (2f) and FC2 saves its input (f): 3f; unfused, ``glu`` saves FC1's output (2f: SiLU's
  input is a view of it), SiLU's output and the offset copy of the up half (``x_linear +
  glu_linear_offset``, both saved by the product) and FC2's input: 5f (``SWIGLU_KEPT``).
  Attention keeps no s x s matrix on either path the trainer builds: Transformer Engine's fused
  attention on GPU, torch's ``scaled_dot_product_attention`` on CPU (gpt.sdpa_attention);
  megatron's unfused core attention, which keeps its softmax probabilities (and which
  ``masked_softmax_fusion`` speeds up), never runs for these causal models, so the plan has no
  term for it. ``selective`` recompute drops only those score matrices, so it plans as ``none``;
  ``full`` keeps each layer's input (h, sequence-split with SP) plus one layer's activations
  recomputed in the backward pass. The
  1F1B schedule keeps pp - stage micro-batches in flight (pp on the first stage).
* log-prob peak (the actor's last stage): one micro-batch's logits over the TP shard of the
  padded vocabulary, the model-dtype output plus ``LOGIT_FP32_COPIES`` (2) fp32 tensors of its
  size alive at once (:func:`agentgym_mega.models.actor.token_logprobs_and_entropy`: the log p it
  keeps and their exponentials in the forward pass, log p and the softmax it recomputes from them
  in the backward pass; docs/results.md has the peak measured on CPU, bf16 or fp32 logits, with
  or without a temperature).
  The critic's value head has no such peak.

Engines (vLLM): each claims ``gpu_memory_utilization`` of every GPU it runs on. Inside that: the
weights (all parameters in the engine dtype / engine_tp), ``ENGINE_OVERHEAD`` (2 GB: the profiled
activation peak, the sampler, CUDA graphs) and the KV cache, the rest: 2 * layers * kv heads per
GPU * head_dim elements per token. An engine whose cache cannot hold one ``rollout.max_model_len``
sequence does not start. Asleep (vLLM sleep, either level) it keeps only the overhead.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

from agentgym_mega.errors import BadInput
from agentgym_mega.models import gpt, mapping
from agentgym_mega.weight_sync.factory import device_buckets

GB = 10**9
FP32 = 4
ADAM_MOMENTS = 2
LOGIT_FP32_COPIES = 2
SWIGLU_KEPT = {True: 3, False: 5}  # MLP-width tensors autograd keeps per token and layer, fused or not
ENGINE_OVERHEAD = 2 * GB
PARAM_ALIGN = 64  # megatron starts each parameter of a distributed-optimizer buffer at 64 elements
BUCKET_ALIGN = 128  # ... and pads each bucket to a multiple of lcm(dp, 128)
# The config.json keys the plan reads; any other key of model.architecture is only compared.
REQUIRED_KEYS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "vocab_size")


class LayoutError(BadInput):
    """A layout that megatron or vLLM refuses to build, whatever the memory."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# -- the model ---------------------------------------------------------------------------------

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
        gpt.check_split(a.layers, a.heads, a.kv_heads, a.ffn, tp, pp)
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


def layer_activation_elements(a: Arch, tp: int, sequence_parallel: bool, fused: bool = True) -> float:
    """Elements one layer keeps per token for its backward pass (no recompute), with megatron's
    fused SwiGLU (``fused``: bias_activation_fusion) or without it."""
    replicated = 4 * a.hidden
    split = 2 * a.q_width + 2 * a.kv_width + SWIGLU_KEPT[fused] * a.ffn
    return replicated / (tp if sequence_parallel else 1) + split / tp


def activation_bytes(a: Arch, tp: int, pp: int, stage: int, sequence_parallel: bool, recompute: str,
                     tokens: int, dtype_bytes: int, fused: bool = True) -> int:
    """Activations a rank of ``stage`` holds at its peak, for micro-batches of ``tokens``."""
    seq_split = tp if sequence_parallel else 1
    layer = layer_activation_elements(a, tp, sequence_parallel, fused)
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
    return loading_bytes(a, engine_dtype_bytes) + device_buckets(transport)[1] * bucket_bytes


def loading_bytes(a: Arch, engine_dtype_bytes: int) -> int:
    """The whole tensors an engine worker holds while loading a layer (vLLM keeps a layer's until
    it is complete): a decoder layer or the embedding, whichever is larger."""
    return max(sum(layer_params(a, 1)), a.vocab * a.hidden) * engine_dtype_bytes
