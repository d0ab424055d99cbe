"""The planner's phases of a trainer GPU against what torch's allocator holds in the trainer's
process through real bf16 training steps of a ~95M Llama (12 layers, hidden 768) at TP=PP=DP=1,
nothing offloaded, each within 10%: start-up / resume is the actor's state (parameters, fp32
gradient buffer, fp32 main parameters and Adam moments); training adds the activations of a
micro-batch and the log-prob peak; the weight sync over CUDA IPC (to a receiver process on the
same GPU standing in for the engine worker) adds the ring of buckets. The formulas are the ones
``agentgym-mega plan`` sums per phase (memory_plan._trainer_gpu); an engine's own share of a GPU
needs vLLM. Skipped without CUDA."""

import json
import multiprocessing as mp
import os

import pytest
import torch

from agentgym_mega import memory_formulas as mf
from agentgym_mega.platform.local_ranks import run_on_local_ranks
from tests.distributed.conftest import model_100m  # noqa: F401  (a fixture this module uses)
from tests.gpu.test_cuda_ipc_sync import _engine_side

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOLERANCE = 0.10  # relative, per phase, as issue #39 asks of the plan
BATCH, MICRO_BATCH, SEQ = 4, 2, 2048
VERSION = 3  # the version _engine_side receives


def step_job(hf_dir: str) -> dict:
    """Bytes allocated once the actor's state exists (after a first step), the most allocated
    during a second step, then during a weight sync over CUDA IPC."""
    from agentgym_mega import platform
    from agentgym_mega.config import apply_overrides, to_dict, validate
    from agentgym_mega.models.actor import MegatronActor
    from agentgym_mega.weight_sync.ipc_ring import CudaIpcSender
    from tests.distributed import megatron_jobs as jobs

    platform.init_distributed(tp=1, pp=1, seed=0)
    cfg = validate(apply_overrides(to_dict(jobs.make_config(1, 1, 1)), ["model.dtype=bfloat16"]))
    actor = MegatronActor(hf_dir, cfg)
    batch = {"input_ids": jobs.tokens(actor.hf_config.vocab_size, batch=BATCH, seq=SEQ, seed=2).cuda()}
    actor.update(batch, jobs.sft_loss, micro_batch_size=MICRO_BATCH)  # Adam's moments come with the first step
    torch.cuda.synchronize()
    out = {"startup": torch.cuda.memory_allocated()}
    torch.cuda.reset_peak_memory_stats()
    actor.update(batch, jobs.sft_loss, micro_batch_size=MICRO_BATCH)
    torch.cuda.synchronize()
    out["training"] = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    sender = CudaIpcSender(bucket_bytes=cfg.weight_sync.bucket_mb << 20, timeout_s=120)
    queue = mp.get_context("spawn").Queue()
    engine = mp.get_context("spawn").Process(target=_engine_side, args=(sender.address, queue, None))
    engine.start()
    try:
        sender.push(actor.export_hf(), version=VERSION)
        out["received"] = len(queue.get(timeout=120)[1])
    finally:
        engine.join(timeout=60)
        sender.close()
    torch.cuda.synchronize()
    out["weight_sync"] = torch.cuda.max_memory_allocated()
    out["bucket_bytes"] = cfg.weight_sync.bucket_mb << 20
    return out


def planned_phases(hf_dir: str, bucket_bytes: int) -> dict:
    with open(os.path.join(hf_dir, "config.json")) as f:
        arch = mf.Arch.of(json.load(f))
    tokens, dtype_bytes = MICRO_BATCH * SEQ, 2
    state = sum(mf.trainer_state(arch, 1, 1, 1, 0, dtype_bytes).values())
    activations = mf.activation_bytes(arch, 1, 1, 0, False, "none", tokens, dtype_bytes)
    return {"startup": state, "training": state + activations + mf.logits_bytes(arch, 1, tokens, dtype_bytes),
            "weight_sync": state + mf.sync_bytes(arch, 1, 1, "cuda_ipc", dtype_bytes, bucket_bytes)}


def test_the_plans_phases_match_what_the_trainer_allocates(model_100m):  # noqa: F811
    measured = run_on_local_ranks(step_job, 1, model_100m)[0]
    assert measured.pop("received") > 0  # the engine's side got the tensors
    planned = planned_phases(model_100m, measured.pop("bucket_bytes"))
    print("\nphase planned_MB measured_MB error")
    errors = {}
    for phase, got in measured.items():
        errors[phase] = (planned[phase] - got) / got
        print(f"{phase} {planned[phase] / 2**20:.0f} {got / 2**20:.0f} {errors[phase]:+.1%}")
    assert set(errors) == {"startup", "training", "weight_sync"}
    assert all(abs(e) <= TOLERANCE for e in errors.values()), {"planned": planned, "measured": measured}
