"""The planner's phases of a trainer GPU against what torch's allocator holds through a real bf16
training step of a ~95M Llama (12 layers, hidden 768) at TP=PP=DP=1, without an engine on the GPU
(split placement, nothing offloaded): start-up / resume is the actor's state (parameters, fp32
gradient buffer, fp32 main parameters and Adam moments), training that plus the activations of a
micro-batch and the log-prob peak, each within 10% of ``torch.cuda`` figures. The formulas are
the ones ``agentgym-mega plan`` sums per phase (memory_plan._trainer_gpu); the phases with an
engine on the GPU (rollout, weight sync) need vLLM. Skipped without CUDA."""

import json
import os

import pytest
import torch

from agentgym_mega import memory_formulas as mf
from agentgym_mega.platform.local_ranks import run_on_local_ranks
from tests.distributed.conftest import model_100m  # noqa: F401  (a fixture this module uses)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOLERANCE = 0.10  # relative, per phase, as issue #39 asks of the plan
BATCH, MICRO_BATCH, SEQ = 4, 2, 2048


def step_job(hf_dir: str) -> dict:
    """Bytes allocated once the actor's state exists (after a first step), and the most
    allocated during a second step."""
    from agentgym_mega import platform
    from agentgym_mega.config import apply_overrides, to_dict, validate
    from agentgym_mega.models.actor import MegatronActor
    from tests.distributed import megatron_jobs as jobs

    platform.init_distributed(tp=1, pp=1, seed=0)
    cfg = validate(apply_overrides(to_dict(jobs.make_config(1, 1, 1)), ["model.dtype=bfloat16"]))
    actor = MegatronActor(hf_dir, cfg)
    batch = {"input_ids": jobs.tokens(actor.hf_config.vocab_size, batch=BATCH, seq=SEQ, seed=2).cuda()}
    actor.update(batch, jobs.sft_loss, micro_batch_size=MICRO_BATCH)  # Adam's moments come with the first step
    torch.cuda.synchronize()
    state = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    actor.update(batch, jobs.sft_loss, micro_batch_size=MICRO_BATCH)
    torch.cuda.synchronize()
    return {"startup": state, "training": torch.cuda.max_memory_allocated()}


def planned_phases(hf_dir: str) -> dict:
    with open(os.path.join(hf_dir, "config.json")) as f:
        arch = mf.Arch.of(json.load(f))
    tokens, dtype_bytes = MICRO_BATCH * SEQ, 2
    state = sum(mf.trainer_state(arch, 1, 1, 1, 0, dtype_bytes).values())
    activations = mf.activation_bytes(arch, 1, 1, 0, False, "none", tokens, dtype_bytes)
    return {"startup": state, "training": state + activations + mf.logits_bytes(arch, 1, tokens, dtype_bytes)}


def test_the_plans_phases_match_what_a_training_step_allocates(model_100m):  # noqa: F811
    measured = run_on_local_ranks(step_job, 1, model_100m)[0]
    planned = planned_phases(model_100m)
    print("\nphase planned_MB measured_MB error")
    errors = {}
    for phase, got in measured.items():
        errors[phase] = (planned[phase] - got) / got
        print(f"{phase} {planned[phase] / 2**20:.0f} {got / 2**20:.0f} {errors[phase]:+.1%}")
    assert all(abs(e) <= TOLERANCE for e in errors.values()), {"planned": planned, "measured": measured}
