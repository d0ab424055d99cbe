"""`export_hf` where TP gathers and pipeline stages meet (TP=2 x PP=2, four gloo ranks): the
gather of the next tensor is in flight while a stage sends or broadcasts the one before, and
every form of the export must still hand over the HF checkpoint's tensors bit for bit."""

import os

import pytest
import torch

from agentgym_mega import platform
from agentgym_mega.models.actor import MegatronActor
from agentgym_mega.models.weights import EXPORT_TO
from agentgym_mega.platform.local_ranks import run_on_local_ranks
from tests.distributed import megatron_jobs as jobs

pytestmark = pytest.mark.slow

TP, PP = 2, 2


def export_job(models: dict) -> dict:
    """Per architecture and per `to`: the (name -> tensor) this rank's export yielded."""
    platform.init_distributed(tp=TP, pp=PP, seed=0)
    cfg = jobs.make_config(TP, PP, TP * PP)
    out = {}
    for arch, hf_dir in models.items():
        actor = MegatronActor(hf_dir, cfg, trainable=False)
        out[arch] = {to: {k: v.clone() for k, v in actor.export_hf(to=to)} for to in EXPORT_TO}
        del actor
    return out


@pytest.fixture(scope="module")
def exported(megatron_models):
    return run_on_local_ranks(export_job, TP * PP, megatron_models)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_every_form_of_the_export_at_tp2_pp2_is_the_checkpoint_bitwise(exported, megatron_models, arch):
    from safetensors.torch import load_file

    original = load_file(os.path.join(megatron_models[arch], "model.safetensors"))

    def same(got: dict) -> bool:
        return all(torch.equal(tensor, original[name]) for name, tensor in got.items())

    ranks = [rank[arch] for rank in exported]  # global rank = stage * TP + TP rank
    first = ranks[0]["first"]
    assert set(first) == set(original) and same(first)
    assert not any(r["first"] for r in ranks[1:])  # gathered to the first rank alone
    stage_heads = [ranks[stage * TP]["stage"] for stage in range(PP)]
    assert all(stage_heads) and sorted(n for s in stage_heads for n in s) == sorted(original)
    assert all(same(s) for s in stage_heads)
    assert not any(ranks[stage * TP + 1]["stage"] for stage in range(PP))
    for r in ranks:
        assert set(r["every"]) == set(original) and same(r["every"])
