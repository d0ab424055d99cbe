"""Hugging Face <-> megatron-core conversion, the work behind `python -m checkpoint_tools.convert`.

``import`` writes a megatron dist-checkpoint (model only) that loads at any TP/PP layout;
``export`` writes HF safetensors shards with config and tokenizer (transformers and vLLM load
them); ``roundtrip`` imports and exports and checks every tensor is bitwise equal; ``compare``
reports logits on fixed prompts: max abs difference and next-token agreement.

:func:`run` runs one of them on this process's ranks under torchrun (their count must be
TP * PP), otherwise on TP * PP spawned local ranks, and returns global rank 0's result; bad
input (missing file, unsupported architecture, a tensor of the wrong shape) comes back as
``{"error": message}``. :func:`export_hf` is export for library callers: it raises instead.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from agentgym_mega import platform
from agentgym_mega.config import validate
from agentgym_mega.errors import BadInput
from agentgym_mega.models import checkpoint, gpt, mapping, weights
from agentgym_mega.models.checkpoint import CheckpointError
from agentgym_mega.platform.local_ranks import run_on_local_ranks

# megatron (through `models.actor`) and transformers are imported inside the functions that use
# them: the process that spawns the ranks (the convert CLI, the trainer's driver exporting a
# checkpoint for evaluation) builds no model.

PROMPTS = [
    "Your goal: go to the red ball",
    "Goal: craft 1 crafting table.\nCrafting commands:\ncraft 1 oak planks using 1 oak log",
    "Action: inventory",
]


def _config(tp: int, pp: int, hf_config):
    # Keep the checkpoint's own precision, so that conversion is lossless.
    dtype = "bfloat16" if getattr(hf_config, "dtype", None) in (torch.bfloat16, "bfloat16") else "float32"
    return validate({"parallel": {"world_size": tp * pp, "tp": tp, "pp": pp}, "model": {"dtype": dtype}})


def _actor(hf_dir: str, tp: int, pp: int, load_weights: bool = True):
    from agentgym_mega.models.actor import MegatronActor

    return MegatronActor(hf_dir, _config(tp, pp, gpt.load_hf_config(hf_dir)), trainable=False,
                         load_weights=load_weights)


def from_checkpoint(ckpt: str, tp: int, pp: int):
    """The frozen actor of megatron checkpoint ``ckpt`` (a directory, or a root with ``latest``)
    at (tp, pp), built from the HF side files saved with it. Collective."""
    path = checkpoint.resolve(ckpt)
    if checkpoint.read_meta(path)["value_head"]:
        raise checkpoint.CheckpointError(f"{path}: a critic checkpoint (value head) has no HF causal-LM form")
    actor = _actor(os.path.join(path, checkpoint.HF_SIDE_FILES), tp, pp, load_weights=False)
    actor.load_checkpoint(path, load_optimizer=False)
    return actor


def do_import(hf: str, out: str, tp: int, pp: int) -> dict:
    return {"checkpoint": _actor(hf, tp, pp).save_checkpoint(out, step=0)}


def do_export(ckpt: str, out: str, tp: int, pp: int) -> dict:
    return {"hf": from_checkpoint(ckpt, tp, pp).save_hf(out)}


def do_roundtrip(hf: str, tp: int, pp: int) -> dict:
    """HF -> megatron checkpoint -> HF, through disk both ways; every tensor compared bitwise."""
    box = [tempfile.mkdtemp(prefix="roundtrip-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    work = box[0]
    do_import(hf, os.path.join(work, "ckpt"), tp, pp)
    exported = do_export(os.path.join(work, "ckpt"), os.path.join(work, "hf"), tp, pp)["hf"]
    if exported is None:  # not the writing rank
        return {}
    geometry = mapping.Geometry.of(gpt.load_hf_config(hf), padded_vocab=0)
    source, back = weights.HFCheckpoint(hf, geometry), weights.HFCheckpoint(exported, geometry)
    mismatched = [n for n in sorted(source.files) if n not in back.files or not torch.equal(source.get(n), back.get(n))]
    unexpected = sorted(set(back.files) - set(source.files))
    shutil.rmtree(work)
    return {"tensors": len(source.files), "mismatched": mismatched, "unexpected": unexpected,
            "bitwise_equal": not mismatched and not unexpected}


def do_compare(hf: str, ckpt: str, tp: int, pp: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    actor = from_checkpoint(ckpt, tp, pp)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    max_diff, agree, total = 0.0, 0, 0
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        ours = actor.full_logits(ids).float()
        with torch.no_grad():
            theirs = reference(ids).logits.float()
        max_diff = max(max_diff, (ours - theirs).abs().max().item())
        agree += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        total += ids.numel()
    return {"prompts": len(PROMPTS), "max_abs_logit_diff": max_diff, "next_token_agreement": agree / total}


COMMANDS = {"import": do_import, "export": do_export, "roundtrip": do_roundtrip, "compare": do_compare}


def _run_rank(command: str, kwargs: dict) -> dict:
    """One rank's work; bad input comes back as {"error": message} rather than a traceback."""
    platform.init_distributed(tp=kwargs["tp"], pp=kwargs["pp"], seed=0)
    try:
        return COMMANDS[command](**kwargs)
    except (BadInput, FileNotFoundError) as exc:
        return {"error": str(exc)}


def _check_inputs(hf: str | None, ckpt: str | None) -> None:
    """Cheap checks before any rank starts: the directories and the architecture."""
    if hf:
        if not os.path.isfile(os.path.join(hf, "config.json")):
            raise FileNotFoundError(f"{hf}: no config.json (not a Hugging Face model directory)")
        mapping.architecture(gpt.load_hf_config(hf))
    if ckpt:
        checkpoint.resolve(ckpt)


def run(command: str, **kwargs) -> dict:
    """Runs ``command`` (a key of COMMANDS, with its keyword arguments) on this process's ranks
    (torchrun) or on TP * PP spawned local ranks; returns global rank 0's result. Bad input found
    before any rank starts raises (FileNotFoundError, BadInput); found on a rank, it is the result's
    "error"."""
    _check_inputs(kwargs.get("hf"), kwargs.get("ckpt"))
    world = kwargs["tp"] * kwargs["pp"]
    if "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != world:
            raise BadInput(f"torchrun started {os.environ['WORLD_SIZE']} ranks; --tp * --pp = {world}")
        return _run_rank(command, kwargs)
    return run_on_local_ranks(_run_rank, world, command, kwargs)[0]


def export_hf(ckpt: str, out: str, tp: int = 1, pp: int = 1) -> str:
    """Writes megatron checkpoint ``ckpt`` (a directory, or a root with ``latest``) as the HF
    directory ``out`` and returns ``out``; raises CheckpointError naming what is wrong."""
    result = run("export", ckpt=ckpt, out=out, tp=tp, pp=pp)
    if "error" in result:
        raise CheckpointError(result["error"])
    return out
