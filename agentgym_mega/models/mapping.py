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


def _split(t: torch.Tensor, parts: int, dim: int, name: str) -> tuple[torch.Tensor, ...]:
    if t.shape[dim] % parts:
        raise MappingError(f"{name}: dim {dim} of shape {tuple(t.shape)} does not split into {parts} TP shards")
    return t.chunk(parts, dim)


def to_megatron(rule: Rule, tensors: list[torch.Tensor], geo: Geometry, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Full HF tensors -> this TP rank's shard of the megatron parameter."""
    name = rule.megatron
    if rule.layout == "replicated":
        return tensors[0]
    if rule.layout == "row":
        return _split(tensors[0], tp_size, 1, name)[tp_rank]
    if rule.layout == "vocab":
        t = tensors[0]
        padded = t.new_zeros((geo.padded_vocab, *t.shape[1:]))
        padded[: t.shape[0]] = t
        return _split(padded, tp_size, 0, name)[tp_rank]
    if rule.layout == "qkv":
        q, k, v = tensors
        g = geo.kv_heads
        fused = torch.cat([q.reshape(g, -1, *q.shape[1:]), k.reshape(g, -1, *k.shape[1:]),
                           v.reshape(g, -1, *v.shape[1:])], dim=1)
        return _split(fused.reshape(-1, *q.shape[1:]), tp_size, 0, name)[tp_rank]
    if rule.layout == "gate_up":
        gate, up = tensors
        return torch.cat([_split(gate, tp_size, 0, name)[tp_rank], _split(up, tp_size, 0, name)[tp_rank]])
    raise MappingError(f"{name}: unknown layout {rule.layout!r}")


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
