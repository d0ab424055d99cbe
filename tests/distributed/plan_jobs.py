"""Work run on spawned gloo ranks by test_memory_plan_alloc.py: what megatron actually allocates
for a trainable actor, measured per rank, for the planner's figures to be compared with."""

from __future__ import annotations

import gc

from agentgym_mega import platform
from agentgym_mega.config import validate
from agentgym_mega.models.actor import MegatronActor


def _storage_bytes(tensors, exclude: set = frozenset()) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once), leaving out the
    storages whose data pointers are in ``exclude``."""
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure(actor) -> dict:
    """Bytes of the model's parameters, of the DDP gradient buffers and of the optimizer state
    (Adam moments and the main parameters the distributed optimizer keeps apart from the model's)."""
    params = list(actor.model.parameters())
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    moments, mains = [], []
    for inner in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        # megatron's helper that checkpoint loading uses: one dummy step allocates the moments
        inner._init_optimizer_states_with_dummy_values()
        moments += [v for state in inner.optimizer.state.values() for k, v in state.items()
                    if k in ("exp_avg", "exp_avg_sq")]
        mains += [p for group in inner.optimizer.param_groups for p in group["params"]]
    return {
        "params": _storage_bytes(params),
        "grads": sum(b.grad_data.untyped_storage().nbytes() for b in actor.model.buffers),
        "optimizer": _storage_bytes(moments) + _storage_bytes(mains, exclude=param_ptrs),
    }


def allocation_job(tp: int, pp: int, world: int, models: dict, dtypes: tuple[str, ...]) -> dict:
    """Per model and dtype: this rank's measured bytes of a trainable actor (weights not loaded: sizes only), with
    the rank's pipeline stage and data-parallel rank."""
    from megatron.core import parallel_state

    platform.init_distributed(tp=tp, pp=pp, seed=0)
    out = {"stage": parallel_state.get_pipeline_model_parallel_rank(),
           "dp_rank": parallel_state.get_data_parallel_rank()}
    for dtype in dtypes:
        cfg = validate({"model": {"dtype": dtype}, "parallel": {"world_size": world, "tp": tp, "pp": pp},
                        "trainer": {"batch_size": 4, "mini_batch_size": 4}})
        for name, hf_dir in models.items():
            actor = MegatronActor(hf_dir, cfg, load_weights=False)
            out[(name, dtype)] = measure(actor)
            del actor
            gc.collect()
    return out


def mlp_saved_bytes(hidden: int, ffn: int, tokens: int) -> dict:
    """Bytes megatron-core's SwiGLU MLP keeps for its backward pass, beyond its input and
    weights, with and without ``bias_activation_fusion``: every tensor autograd saves during the
    forward pass, each storage counted once (a view keeps its whole storage alive)."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    platform.init_distributed(tp=1, pp=1, seed=0)
    out = {}
    for fused in (True, False):
        config = TransformerConfig(num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=4,
                                   gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                                   add_bias_linear=False, bias_activation_fusion=fused, params_dtype=torch.float32)
        mlp = MLP(config, MLPSubmodules(linear_fc1=tensor_parallel.ColumnParallelLinear,
                                        linear_fc2=tensor_parallel.RowParallelLinear))
        x = torch.randn(tokens, 1, hidden, requires_grad=True)
        skip = {t.untyped_storage().data_ptr() for t in [x, *mlp.parameters()]}
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            output, _ = mlp(x)
        out[fused] = _storage_bytes(saved, exclude=skip)
        output.sum().backward()  # the graph is complete: what was saved is what the backward pass reads
    return out
