"""Resumable training checkpoints with megatron's ``dist_checkpointing``: model, optimizer,
LR scheduler, RNG and trainer state (global step, horizon stage, data position, ...).

Layout on disk: ``ROOT/iter_0000042/`` per checkpoint (the dist-checkpoint files, ``meta.json``
and ``hf/`` with the model's config and tokenizer, which export needs) and ``ROOT/latest`` naming
the newest complete one. Saving writes ``iter_....tmp`` and renames it only once every rank has
written, then replaces ``latest`` atomically: a save killed at any point leaves the previous
checkpoint and ``latest`` as they were.

The model loads at any TP/PP layout (dist_checkpointing reshards); optimizer and RNG state are
restored only at the layout they were saved with, which is what resuming a run needs. A model shard
that has not stepped yet (or has no optimizer, e.g. a converted HF model) saves the model only.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import torch
import torch.distributed as dist

from agentgym_mega import files, platform
from agentgym_mega.errors import BadInput
from agentgym_mega.models import weights

# megatron is imported inside the functions that use it: the trainer's driver imports this module
# for checkpoint paths and metadata and never builds a model.

LATEST = "latest"
META = "meta.json"
HF_SIDE_FILES = "hf"


class CheckpointError(BadInput):
    pass


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if platform.has_cuda():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


# The distributed optimizer's parallel format (each rank writes its own buffers; reshardable over
# DP only). megatron-core 0.16's TP/PP-reshardable format fails on torch Adam's "step" state
# without Transformer Engine, so optimizer state is restored at the saved TP/PP layout only.
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}


def _sharded_state(shard, full: bool, loading: bool) -> dict:
    """What dist_checkpointing saves or fills: always the model; with ``full`` the optimizer and
    this rank's RNG state (one object per (pp, tp) position; DP replicas share rank 0's)."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {"model": weights.unwrap(shard.model).sharded_state_dict()}
    if full:
        if loading:
            _allocate_optimizer_state(shard.optimizer)
        state["optimizer"] = shard.optimizer.sharded_state_dict(
            state["model"], is_loading=loading, metadata=_OPTIMIZER_FORMAT)
        state["rng"] = ShardedObject(
            "rng_state", _rng_state(),
            (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()),
            (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
            replica_id=ps.get_data_parallel_rank(),
        )
    return state


def _has_optimizer_state(shard) -> bool:
    """False before the first step: there are no Adam moments yet, only the model to save."""
    if shard.optimizer is None:
        return False
    return any(inner.optimizer.state for inner in getattr(shard.optimizer, "chained_optimizers", [shard.optimizer]))


def _allocate_optimizer_state(optimizer) -> None:
    """A fresh optimizer has no Adam moments to load into; megatron's own helper allocates them
    (the values are overwritten by the load)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer) -> None:
    """megatron-core 0.16 restores torch Adam's step count into the param groups, then writes the
    pre-load value back into each parameter's ``step`` (it treats it as local state) and leaves
    one ``step`` tensor shared by all parameters, which Adam's foreach update would then increment
    once per parameter. Give each parameter its own tensor holding the checkpoint's count.
    Fused optimizers (Transformer Engine's and Apex's FusedAdam) keep the count in the param
    group alone, where megatron restored it: their per-parameter state has no ``step``."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.optimizer.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                state = inner.optimizer.state[param]
                if "step" in state:
                    state["step"] = torch.full_like(state["step"], group["step"])


def save(root: str, step: int, shard, trainer_state: dict) -> str:
    """Saves a checkpoint of ``shard`` (collective) and returns its directory."""
    from megatron.core import dist_checkpointing

    final = os.path.join(root, f"iter_{step:07d}")
    writer = dist.get_rank() == 0
    if writer:
        os.makedirs(root, exist_ok=True)
        files.atomic_dir(final)
    dist.barrier()
    tmp = files.temp_path(final)
    with_optimizer = _has_optimizer_state(shard)
    state = _sharded_state(shard, full=with_optimizer, loading=False)
    state["scheduler"] = shard.scheduler.state_dict() if shard.scheduler else None
    state["trainer"] = dict(trainer_state, global_step=step)
    dist_checkpointing.save(state, tmp)
    dist.barrier()  # every rank's shards are on disk
    if writer:
        side = os.path.join(tmp, HF_SIDE_FILES)
        os.makedirs(side)
        weights.copy_side_files(shard.hf_dir, side)
        meta = {"step": step, "layout": _layout(), "padded_vocab": weights.unwrap(shard.model).vocab_size,
                "value_head": shard.value_head, "optimizer": with_optimizer, "trainer": state["trainer"]}
        files.write_text_atomic(os.path.join(tmp, META), json.dumps(meta, indent=2))
        files.commit_dir(tmp, final)
        files.write_text_atomic(os.path.join(root, LATEST), os.path.basename(final) + "\n")
    dist.barrier()
    return final


def resolve(path: str) -> str:
    """A checkpoint directory, or a root whose ``latest`` names one."""
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            path = os.path.join(path, f.read().strip())
    if not os.path.exists(path) and os.path.isfile(os.path.join(files.previous_path(path), META)):
        path = files.previous_path(path)  # a re-save of this step was killed mid-replace
    if not os.path.isfile(os.path.join(path, META)):
        raise CheckpointError(f"{path}: not a checkpoint (no {META}, no {LATEST} file)")
    return path


def read_meta(path: str) -> dict:
    with open(os.path.join(resolve(path), META)) as f:
        return json.load(f)


def load(path: str, shard, load_optimizer: bool = True) -> dict:
    """Loads ``path`` into ``shard`` (collective); returns the trainer state saved with it."""
    from megatron.core import dist_checkpointing

    path = resolve(path)
    meta = read_meta(path)
    padded = weights.unwrap(shard.model).vocab_size
    if meta["padded_vocab"] != padded:
        raise CheckpointError(f"{path}: embedding.word_embeddings.weight has {meta['padded_vocab']} rows "
                              f"(padded vocabulary), this model {padded}")
    if meta["value_head"] != shard.value_head:
        raise CheckpointError(f"{path}: value_head={meta['value_head']} but this model has "
                              f"value_head={shard.value_head}")
    full = (load_optimizer and shard.optimizer is not None and meta["optimizer"]
            and meta["layout"] == _layout())
    state = dist_checkpointing.load(_sharded_state(shard, full, loading=True), path)
    shard.model.load_state_dict(state["model"])
    if full:
        with torch.no_grad():  # fp32 main params are views of the model's leaf parameters
            shard.optimizer.load_state_dict(state["optimizer"])
            _restore_adam_steps(shard.optimizer)
        shard.scheduler.load_state_dict(state["scheduler"])
        _set_rng_state(state["rng"])
    return state["trainer"]
