"""Per-architecture tables between Hugging Face tensor names and megatron-core ``GPTModel``
parameters, and the tensor-parallel layouts those tables name.

The tables are data: import (HF -> megatron), export (megatron -> HF) and the weight
synchroniser all read them, and adding an architecture means adding a table, not code.
A rule says which HF tensors make one megatron parameter and how that parameter is fused and
split across tensor-parallel ranks (its ``layout``):

* ``replicated``: the same full tensor on every TP rank (norm weights);
* ``row``: split along dim 1 (megatron's RowParallelLinear);
* ``vocab``: rows padded to the padded vocabulary, then split along dim 0;
* ``qkv``: q, k and v fused per query group, ``[q heads of group g, k_g, v_g]`` for each group,
  then split along dim 0 (so each TP rank holds whole groups);
* ``gate_up``: gate and up each split along dim 0, and rank r holds ``[gate_r; up_r]``.
"""

from __future__ import annotations

import dataclasses

import torch

from agentgym_mega.errors import BadInput

LAYER = "{i}"  # placeholder for the global layer index in both name families


@dataclasses.dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    layout: str
    exported: bool = True  # False for a tied LM head: HF stores it once, as the embedding

    @property
    def per_layer(self) -> bool:
        return LAYER in self.megatron

    def at(self, layer: int | None) -> "Rule":
        """The rule with the layer placeholder filled in."""
        if not self.per_layer:
            return self
        fill = str(layer)
        return dataclasses.replace(
            self, megatron=self.megatron.replace(LAYER, fill), hf=tuple(h.replace(LAYER, fill) for h in self.hf)
        )


@dataclasses.dataclass(frozen=True)
class Architecture:
    hf_name: str  # config.architectures[0]
    rules: tuple[Rule, ...]
    qkv_bias: bool


_EMBEDDING = Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")
_LM_HEAD = Rule("output_layer.weight", ("lm_head.weight",), "vocab")
_TIED_LM_HEAD = Rule("output_layer.weight", ("model.embed_tokens.weight",), "vocab", exported=False)
_FINAL_NORM = Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated")

_L, _H = "decoder.layers.{i}.", "model.layers.{i}."
_DECODER_LAYER = (
    Rule(_L + "input_layernorm.weight", (_H + "input_layernorm.weight",), "replicated"),
    Rule(
        _L + "self_attention.linear_qkv.weight",
        (_H + "self_attn.q_proj.weight", _H + "self_attn.k_proj.weight", _H + "self_attn.v_proj.weight"),
        "qkv",
    ),
    Rule(_L + "self_attention.linear_proj.weight", (_H + "self_attn.o_proj.weight",), "row"),
    Rule(_L + "pre_mlp_layernorm.weight", (_H + "post_attention_layernorm.weight",), "replicated"),
    Rule(_L + "mlp.linear_fc1.weight", (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), "gate_up"),
    Rule(_L + "mlp.linear_fc2.weight", (_H + "mlp.down_proj.weight",), "row"),
)
_QKV_BIAS = Rule(
    _L + "self_attention.linear_qkv.bias",
    (_H + "self_attn.q_proj.bias", _H + "self_attn.k_proj.bias", _H + "self_attn.v_proj.bias"),
    "qkv",
)

ARCHITECTURES = {
    "LlamaForCausalLM": Architecture(
        "LlamaForCausalLM", (_EMBEDDING, *_DECODER_LAYER, _FINAL_NORM, _LM_HEAD), qkv_bias=False
    ),
    "Qwen2ForCausalLM": Architecture(
        "Qwen2ForCausalLM", (_EMBEDDING, *_DECODER_LAYER, _QKV_BIAS, _FINAL_NORM, _LM_HEAD), qkv_bias=True
    ),
}

# Transformer Engine's layer spec fuses each norm into the linear layer that follows it.
TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


class MappingError(BadInput):
    """A checkpoint that does not fit the model; the message names the tensor."""


def architecture(hf_config) -> Architecture:
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    raise MappingError(
        f"architectures={names}: no mapping table; supported: {', '.join(sorted(ARCHITECTURES))}"
    )


def rules(hf_config, te_spec: bool = False) -> list[Rule]:
    """The architecture's rules for this config: the tied LM head reads the embedding, and the TE
    spec renames the fused norms."""
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    out = []
    for rule in architecture(hf_config).rules:
        if rule is _LM_HEAD and tied:
            rule = _TIED_LM_HEAD
        if te_spec:
            for local, te in TE_NAMES.items():
                if rule.megatron.endswith(local):
                    rule = dataclasses.replace(rule, megatron=rule.megatron.removesuffix(local) + te)
        out.append(rule)
    return out


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The shapes a mapping needs, read from the HF config once."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    padded_vocab: int
    layers: int

    @classmethod
    def of(cls, hf_config, padded_vocab: int) -> "Geometry":
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        return cls(
            hidden=hf_config.hidden_size,
            heads=heads,
            kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            ffn=hf_config.intermediate_size,
            vocab=hf_config.vocab_size,
            padded_vocab=padded_vocab,
            layers=hf_config.num_hidden_layers,
        )

    def hf_shape(self, name: str) -> tuple[int, ...]:
        """The full shape of an HF tensor, from its name's last two parts."""
        h, hd = self.hidden, self.head_dim
        table = {
            "embed_tokens.weight": (self.vocab, h),
            "lm_head.weight": (self.vocab, h),
            "q_proj.weight": (self.heads * hd, h),
            "k_proj.weight": (self.kv_heads * hd, h),
            "v_proj.weight": (self.kv_heads * hd, h),
            "q_proj.bias": (self.heads * hd,),
            "k_proj.bias": (self.kv_heads * hd,),
            "v_proj.bias": (self.kv_heads * hd,),
            "o_proj.weight": (h, self.heads * hd),
            "gate_proj.weight": (self.ffn, h),
            "up_proj.weight": (self.ffn, h),
            "down_proj.weight": (h, self.ffn),
        }
        key = ".".join(name.split(".")[-2:])
        return table.get(key, (h,))  # everything else is a norm weight


def _rows(rows: int, parts: int, rank: int, name: str) -> tuple[int, int]:
    """Rank ``rank``'s contiguous ``[start, stop)`` of ``rows`` split into ``parts`` equal shares."""
    if rows % parts:
        raise MappingError(f"{name}: {rows} rows or columns do not split into {parts} TP shards")
    share = rows // parts
    return rank * share, (rank + 1) * share


def shard_reads(rule: Rule, geo: Geometry, tp_rank: int, tp_size: int) -> list[tuple[int, int, int] | None]:
    """What this TP rank's shard needs of each of the rule's HF tensors: ``(dim, start, stop)``,
    a contiguous range along one dimension, or None for the whole tensor. A loader reads just
    that (safetensors ``get_slice``) and :func:`assemble` builds the shard from the pieces."""
    name = rule.megatron
    if rule.layout == "replicated":
        return [None]
    if rule.layout == "row":
        return [(1, *_rows(geo.hf_shape(rule.hf[0])[1], tp_size, tp_rank, name))]
    if rule.layout == "vocab":
        # Rows past the real vocabulary are padding: the last ranks may read few rows or none.
        start, stop = _rows(geo.padded_vocab, tp_size, tp_rank, name)
        return [(0, min(start, geo.vocab), min(stop, geo.vocab))]
    if rule.layout == "qkv":
        # Each rank holds whole query groups: its heads' rows of q and its groups' rows of k and v.
        first, last = _rows(geo.kv_heads, tp_size, tp_rank, name)
        q_rows = geo.heads // geo.kv_heads * geo.head_dim
        kv = (0, first * geo.head_dim, last * geo.head_dim)
        return [(0, first * q_rows, last * q_rows), kv, kv]
    if rule.layout == "gate_up":
        return [(0, *_rows(geo.ffn, tp_size, tp_rank, name))] * 2
    raise MappingError(f"{name}: unknown layout {rule.layout!r}")


def read(tensor: torch.Tensor, part: tuple[int, int, int] | None) -> torch.Tensor:
    """``tensor`` cut as :func:`shard_reads` says (what a slicing loader reads from disk)."""
    if part is None:
        return tensor
    dim, start, stop = part
    return tensor.narrow(dim, start, stop - start)


def shard_shape(rule: Rule, pieces: list[torch.Tensor], geo: Geometry, tp_size: int) -> tuple[int, ...]:
    """The shape of the megatron shard :func:`assemble` builds from ``pieces``."""
    tail = tuple(pieces[0].shape[1:])
    if rule.layout == "vocab":
        return (geo.padded_vocab // tp_size, *tail)
    if rule.layout in ("qkv", "gate_up"):
        return (sum(p.shape[0] for p in pieces), *tail)
    return tuple(pieces[0].shape)


def assemble(rule: Rule, pieces: list[torch.Tensor], geo: Geometry, tp_size: int, out: torch.Tensor) -> None:
    """Writes the megatron shard made of the pieces :func:`shard_reads` named (in the rule's HF
    order) into ``out``, with no full-size temporary."""
    shape = shard_shape(rule, pieces, geo, tp_size)
    if tuple(out.shape) != shape:
        raise MappingError(f"{rule.megatron}: mapped shard {shape} != parameter {tuple(out.shape)}")
    if rule.layout in ("replicated", "row"):
        out.copy_(pieces[0])
    elif rule.layout == "vocab":
        rows = pieces[0].shape[0]
        out[:rows].copy_(pieces[0])
        out[rows:].zero_()
    elif rule.layout == "qkv":
        groups = geo.kv_heads // tp_size
        fused = out.view(groups, -1, *shape[1:])
        start = 0
        for piece in pieces:
            piece = piece.reshape(groups, -1, *shape[1:])
            fused[:, start:start + piece.shape[1]].copy_(piece)
            start += piece.shape[1]
    elif rule.layout == "gate_up":
        gate, up = pieces
        out[: gate.shape[0]].copy_(gate)
        out[gate.shape[0]:].copy_(up)
    else:
        raise MappingError(f"{rule.megatron}: unknown layout {rule.layout!r}")


def to_megatron(rule: Rule, tensors: list[torch.Tensor], geo: Geometry, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Full HF tensors -> this TP rank's shard of the megatron parameter."""
    pieces = [read(t, part) for t, part in zip(tensors, shard_reads(rule, geo, tp_rank, tp_size))]
    out = pieces[0].new_empty(shard_shape(rule, pieces, geo, tp_size))
    assemble(rule, pieces, geo, tp_size, out)
    return out


def _cat(tensors: list[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat, except that a single tensor comes back as itself (TP=1: a view, no copy)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim)


def to_hf(rule: Rule, shards: list[torch.Tensor], geo: Geometry) -> list[torch.Tensor]:
    """Every TP rank's shard of a megatron parameter (in TP rank order) -> full HF tensors.
    Where the HF tensor is a slice of one shard (TP=1), it is a view of that shard, not a copy;
    Q, K and V always copy once (their rows interleave per query group)."""
    if rule.layout == "replicated":
        return [shards[0]]
    if rule.layout == "row":
        return [_cat(shards, 1)]
    if rule.layout == "vocab":
        return [_cat(shards, 0)[: geo.vocab]]
    if rule.layout == "qkv":
        tail = shards[0].shape[1:]
        q_rows = geo.heads // geo.kv_heads * geo.head_dim
        per_group = [s.reshape(-1, q_rows + 2 * geo.head_dim, *tail) for s in shards]
        parts = zip(*(g.split([q_rows, geo.head_dim, geo.head_dim], dim=1) for g in per_group))
        return [torch.cat(p, 0).reshape(-1, *tail) for p in parts]
    if rule.layout == "gate_up":
        halves = [s.chunk(2, 0) for s in shards]
        return [_cat([h[0] for h in halves], 0), _cat([h[1] for h in halves], 0)]
    raise MappingError(f"{rule.megatron}: unknown layout {rule.layout!r}")
