"""A megatron-core ``GPTModel`` built from a Hugging Face config (Qwen2/Qwen2.5, Llama 3.x).

The model is this rank's part: its TP shard of every layer it holds and, with PP, only its
stage's layers (embedding on the first stage, final norm and LM head on the last). Call
:func:`agentgym_mega.platform.init_distributed` first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math

import torch

from agentgym_mega import platform
from agentgym_mega.models import mapping

# transformers and megatron are imported inside the functions that use them: the planner
# (memory_plan) and the trainer's driver import this module and never build a model.

# Vocabulary rows are padded to a multiple of this (and of TP): a fixed multiple keeps the padded
# size, and so every checkpoint's tensor shapes, the same across TP sizes that divide it.
VOCAB_MULTIPLE = 128
# Megatron implements llama3 rope scaling with the original recipe's fixed constants only.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclasses.dataclass(frozen=True)
class ModelSplit:
    """How one model is split over ranks (and what its layers recompute); from ``parallel`` in
    the config. Not memory_plan.Layout, which places a whole run."""

    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"  # none | selective | full

    @classmethod
    def of(cls, parallel) -> "ModelSplit":
        return cls(parallel.tp, parallel.pp, parallel.sequence_parallel, parallel.recompute)


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


# megatron's fusion flags (TransformerConfig), in the order fusions() lists them
FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
           "gradient_accumulation_fusion", "apply_rope_fusion")
# The CUDA extensions megatron imports for the fused causal/masked/plain softmax (apex builds them)
_SOFTMAX_KERNELS = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda")


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def fusions(cuda: bool) -> dict[str, bool]:
    """Which of megatron's fused paths a model built here runs, by TransformerConfig flag (FUSIONS).

    Each is on only where its kernel exists, as megatron asserts (or fails at the first step)
    otherwise:

    * on CUDA, SwiGLU (``bias_activation_fusion``) and bias-dropout-add (``bias_dropout_fusion``)
      are megatron's ``torch.compile``d functions, which need Triton (torch's CUDA wheels bring
      it); the fused softmax needs apex's softmax extensions; the weight gradient GEMM that adds
      into ``main_grad`` (``gradient_accumulation_fusion``) needs apex's
      ``fused_weight_gradient_mlp_cuda`` (megatron's own linears, the output layer too, refuse to
      build without it, Transformer Engine or not); the fused rotary embedding is Transformer
      Engine's.
    * on CPU, SwiGLU, rotary embedding and gradient accumulation run fused through the CPU
      layer's stand-ins (platform.cpu_megatron) once it is enabled; the softmax is torch's
      (sdpa_attention) and the bias-dropout-add has no bias or dropout to fuse.
    """
    if not cuda:
        stand_ins = platform.cpu_megatron.is_enabled()
        return {"bias_activation_fusion": stand_ins, "bias_dropout_fusion": False, "masked_softmax_fusion": False,
                "gradient_accumulation_fusion": stand_ins, "apply_rope_fusion": stand_ins}
    from torch.utils._triton import has_triton

    triton = has_triton()
    return {"bias_activation_fusion": triton, "bias_dropout_fusion": triton,
            "masked_softmax_fusion": all(map(_importable, _SOFTMAX_KERNELS)),
            "gradient_accumulation_fusion": _importable("fused_weight_gradient_mlp_cuda"),
            "apply_rope_fusion": _te_rope()}


def _te_rope() -> bool:
    """Whether megatron found Transformer Engine's fused rotary embedding (its own check)."""
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils.fused_apply_rotary_pos_emb is not None


def padded_vocab_size(vocab: int, tp: int) -> int:
    multiple = math.lcm(VOCAB_MULTIPLE, tp)
    return -(-vocab // multiple) * multiple


def resolve_dtype(name: str = "auto") -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if platform.has_cuda() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def load_hf_config(hf_dir: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(hf_dir)


def rope_settings(hf_config) -> dict:
    """GPTModel's rope arguments; refuses scalings megatron cannot reproduce exactly."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    out = {"rotary_base": theta, "rope_scaling": False}
    if kind == "llama3":
        for key, fixed in _LLAMA3_FIXED.items():
            if float(params.get(key, fixed)) != fixed:
                raise mapping.MappingError(f"rope_parameters.{key}={params[key]}: megatron's llama3 rope "
                                           f"scaling supports only {fixed}")
        out.update(rope_scaling=True, rope_scaling_factor=float(params["factor"]))
    elif kind != "default":
        raise mapping.MappingError(f"rope_parameters.rope_type={kind!r}: supported: default, llama3")
    return out


def check_architecture(hf_config) -> mapping.Architecture:
    """The architecture's mapping table; refuses, naming the key, what the model builder cannot
    build (also used by the memory planner, which has no megatron to ask)."""
    arch = mapping.architecture(hf_config)
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise mapping.MappingError(f"hidden_act={hf_config.hidden_act!r}: only silu (SwiGLU) is mapped")
    if getattr(hf_config, "use_sliding_window", False):
        raise mapping.MappingError("use_sliding_window=true: sliding-window attention is not mapped")
    rope_settings(hf_config)
    return arch


def check_split(layers: int, heads: int, kv_heads: int, ffn: int, tp: int, pp: int) -> None:
    """Refuses, naming the config keys, a TP/PP split megatron cannot make of these layers."""
    if layers % pp:
        raise mapping.MappingError(f"num_hidden_layers={layers} does not split evenly over pp={pp} stages")
    uneven = [f"{key}={n}" for key, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)) if n % tp]
    if uneven:
        raise mapping.MappingError(
            f"num_attention_heads={heads} and num_key_value_heads={kv_heads} do not split over tp={tp}: "
            f"{uneven[0] + ' is not' if len(uneven) == 1 else 'neither is'} divisible by tp={tp}; "
            "megatron gives each TP rank whole query groups")
    if ffn % tp:
        raise mapping.MappingError(
            f"intermediate_size={ffn} is not divisible by tp={tp}: megatron splits the MLP evenly over TP ranks")


def _leave_uninitialised(weight: torch.Tensor) -> None:
    """megatron's init method for weights that are loaded next."""


def transformer_config(hf_config, split: ModelSplit, dtype: torch.dtype, fused: bool = True):
    """megatron's TransformerConfig of this model; ``fused``: the fused paths available here
    (:func:`fusions`), else megatron's unfused ones (the reference tests/gpu compares against)."""
    from megatron.core.transformer import TransformerConfig

    arch = check_architecture(hf_config)
    geo = mapping.Geometry.of(hf_config, padded_vocab=0)
    check_split(geo.layers, geo.heads, geo.kv_heads, geo.ffn, split.tp, split.pp)
    if split.sequence_parallel and not te_available():
        raise mapping.MappingError(
            "parallel.sequence_parallel=true needs Transformer Engine (megatron's local layer spec "
            "norms have no sequence-parallel path); set it false where TE is absent (CPU)")
    recompute = {} if split.recompute == "none" else {"recompute_granularity": split.recompute}
    if split.recompute == "full":
        recompute.update(recompute_method="uniform", recompute_num_layers=1)
    fused_paths = fusions(platform.has_cuda()) if fused else dict.fromkeys(FUSIONS, False)
    return TransformerConfig(
        num_layers=geo.layers,
        hidden_size=geo.hidden,
        ffn_hidden_size=geo.ffn,
        num_attention_heads=geo.heads,
        num_query_groups=geo.kv_heads,
        kv_channels=geo.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=split.tp,
        pipeline_model_parallel_size=split.pp,
        sequence_parallel=split.sequence_parallel,
        # Each rank allocates only its shard, on its device (megatron's CPU initialisation would
        # build every full-size fp32 matrix first, to split it). The weights are filled from HF
        # or a checkpoint right after, so drawing random ones is skipped; initialisation itself
        # stays on, as it is what marks each tensor's TP split for gradient clipping.
        use_cpu_initialization=False,
        init_method=_leave_uninitialised,
        output_layer_init_method=_leave_uninitialised,
        embedding_init_method=_leave_uninitialised,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # the unfused paths compute the same thing with more passes, copies and kept activations
        **fused_paths,
        **recompute,
    )


class ValueHead(torch.nn.Module):
    """The critic's scalar head in place of the LM head: ``value = weight @ h + bias``. Replicated
    on every TP rank (one output cannot be split); with sequence parallel it first gathers the
    sequence.

    Its parameters are ``weight`` ``[1, hidden]`` and ``bias`` ``[1]``, the names megatron's
    own output layer has: ``LanguageModule.sharded_state_dict`` looks up ``output_layer.weight``
    on the last stage of every untied model, and the checkpoint, the optimizer's parameter map and
    :mod:`agentgym_mega.models.weights` all name the head by them."""

    def __init__(self, hidden: int, sequence_parallel: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        if self.sequence_parallel:
            # Every TP rank computes the full head, so its input gradient only needs splitting
            # back along the sequence, not summing across ranks.
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None  # GPTModel unpacks (output, bias)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Both tensors whole and replicated: TP rank 0 of DP rank 0 writes them, every rank loads
        the full tensor (at any TP size)."""
        from megatron.core import parallel_state as ps
        from megatron.core.utils import make_sharded_tensor_for_checkpoint

        replica_id = (0, ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(with_context_parallel=True))
        return {f"{prefix}{name}": make_sharded_tensor_for_checkpoint(
                    param, f"{prefix}{name}", prepend_offsets=sharded_offsets, replica_id=replica_id)
                for name, param in self.named_parameters(recurse=False)}


@functools.cache
def sdpa_attention() -> type:
    """megatron's local-spec core attention computed by ``torch.nn.functional.scaled_dot_product_attention``
    (defined on first use, like :func:`value_gpt_model`).

    megatron's ``DotProductAttention`` materialises every ``[b, heads, s, s]`` score matrix, masks
    it and keeps the probabilities for the backward pass; where Transformer Engine is absent (CPU)
    that was a third of a training step's time at 600-token sequences. torch's fused kernel
    computes the same causal attention blockwise. Only the case the model shards run is taken over:
    causal, no explicit mask, vanilla softmax, no window; anything else goes to megatron's own path.
    """
    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SdpaAttention(DotProductAttention):
        def _fused(self, attention_mask, attn_mask_type) -> bool:
            config = self.config
            return (attention_mask is None and (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
                    and config.softmax_type == "vanilla" and config.window_size is None
                    and not config.apply_query_key_layer_scaling)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None or attention_bias is not None \
                    or not self._fused(attention_mask, attn_mask_type):
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)
            # [s, b, heads, d] -> [b, heads, s, d]; each query group serves its heads in place
            query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            dropout = self.attention_dropout.p if self.training else 0.0
            rng = (tensor_parallel.get_cuda_rng_tracker().fork() if dropout and not self.config.sequence_parallel
                   else contextlib.nullcontext())
            with rng:
                context = torch.nn.functional.scaled_dot_product_attention(
                    query, key, value, dropout_p=dropout, is_causal=True, scale=self.softmax_scale,
                    enable_gqa=self.num_attention_heads_per_partition > self.num_query_groups_per_partition)
            batch, _, seq, _ = context.shape  # -> [s, b, heads * d]
            return context.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)

    return SdpaAttention


@functools.cache
def policy_gpt_model() -> type:
    """The actor's model class: GPTModel whose last stage returns the logits in megatron's own
    ``[s, b, V / tp]`` order, or only some of them (defined on first use, like
    :func:`value_gpt_model`).

    GPTModel hands logits out as ``[b, s, V]`` through a copy, and in the backward pass the
    transposed gradient is copied twice more (megatron's output layer makes it contiguous for both
    GEMMs). The log-prob head reads megatron's order instead.

    ``loss_mask`` (GPTModel's keyword, ``[b, s]``) names the rows wanted: the output layer then
    runs on those hidden states only and returns ``[n, V / tp]``, the rows in ``[s, b]`` order
    (``hidden[loss_mask.t()]``). An agent's loss covers its own replies, a fraction of each
    episode, so this spares the rest of the LM head's GEMMs and logits. Under sequence
    parallelism the hidden states are split along the sequence until the output layer gathers
    them, so there all rows are computed (``[s, b, V / tp]``). Labels, multi-token prediction and
    inference contexts are GPTModel's business, never the policy's: they are refused."""
    from megatron.core.models.gpt import GPTModel

    class PolicyGPTModel(GPTModel):
        def _postprocess(self, hidden_states, **kwargs):
            if not self.post_process:
                return hidden_states
            if (kwargs.get("labels") is not None or kwargs.get("mtp_in_postprocess")
                    or kwargs.get("inference_context") is not None):
                raise NotImplementedError("the policy model returns logits only: no labels, "
                                          "multi-token prediction or inference context")
            rows = kwargs.get("loss_mask")
            if rows is not None and not self.config.sequence_parallel:
                hidden_states = hidden_states[rows.bool().t()]
            weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
            logits, _ = self.output_layer(hidden_states, weight=weight,
                                          runtime_gather_output=kwargs.get("runtime_gather_output"))
            return logits

    return PolicyGPTModel


@functools.cache
def value_gpt_model() -> type:
    """The critic's model class: GPTModel with a :class:`ValueHead` in place of the LM head on
    the last stage (defined on first use: megatron is imported only when a model is built)."""
    from megatron.core.models.gpt import GPTModel

    class ValueGPTModel(GPTModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.post_process:
                self.output_layer = ValueHead(self.config.hidden_size, self.config.sequence_parallel,
                                              self.config.params_dtype)

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
            # LanguageModule marks the untied LM head's tensors allow_shape_mismatch, for the
            # vocabulary padding (a mismatched load zero-fills). The value head has no padding:
            # a shape that differs from the checkpoint's must fail the load, not zero the head.
            state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
            if self.post_process:
                for name, _ in self.output_layer.named_parameters():
                    state[f"{prefix}output_layer.{name}"].allow_shape_mismatch = False
            return state

    return ValueGPTModel


def build_gpt(hf_config, split: ModelSplit, dtype: torch.dtype, value_head: bool = False, fused: bool = True):
    """This rank's ``GPTModel`` for ``hf_config``, uninitialised (fill it from
    :mod:`agentgym_mega.models.weights` or a checkpoint): the policy's model, whose logits come
    out ``[s, b, V / tp]``, or with ``value_head`` the critic's, whose scalar head replaces the LM
    head (``[b, s, 1]``; embeddings are never tied). ``fused``: see :func:`transformer_config`."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import gpt_layer_specs

    config = transformer_config(hf_config, split, dtype, fused)
    if te_available():
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
        spec.submodules.self_attention.submodules.core_attention = sdpa_attention()
    tied = bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head
    model_class = value_gpt_model() if value_head else policy_gpt_model()
    model = model_class(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(hf_config.vocab_size, split.tp),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        **rope_settings(hf_config),
    )
    return model.to(platform.device())
