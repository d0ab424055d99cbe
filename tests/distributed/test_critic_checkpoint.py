"""The critic (value head in place of the LM head) saves, resumes and exports like the actor, on
2 gloo ranks (fp32, CPU): one launch at TP=2 that saves and resumes, one at PP=2 that does the
same and also loads the TP=2 checkpoint (see megatron_jobs.critic_checkpoint_job)."""

import os

import pytest
import torch

from agentgym_mega.platform.local_ranks import run_on_local_ranks
from tests.distributed import megatron_jobs as jobs

pytestmark = pytest.mark.slow

ARCHS = ["qwen2", "llama"]
LAYOUTS = [(2, 1), (1, 2)]
RESHARD_TOL = 1e-5  # same weights at another TP/PP layout: only the reduction order differs
HF_TOL = 1e-4  # megatron's forward against transformers', fp32


@pytest.fixture(scope="module")
def critic_runs(megatron_models, tmp_path_factory):
    work = tmp_path_factory.mktemp("critic-runs")
    runs = {}
    for tp, pp in LAYOUTS:
        load_from = str(work / "tp2pp1") if (tp, pp) != (2, 1) else None
        runs[(tp, pp)] = run_on_local_ranks(jobs.critic_checkpoint_job, tp * pp, tp, pp, megatron_models,
                                            str(work / f"tp{tp}pp{pp}"), load_from)
    return runs


def _layout_id(layout):
    return f"tp{layout[0]}pp{layout[1]}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
def test_critic_checkpoint_resumes_bitwise(critic_runs, arch, layout):
    for got in (rank[arch] for rank in critic_runs[layout]):  # every rank returns the same results
        losses = [h["loss"] for h in got["history"]]
        assert all(b < a for a, b in zip(losses, losses[1:])), losses
        # The value head and the backbone come back exactly: the same values on a fixed batch ...
        assert torch.equal(got["loaded_values"], got["saved_values"])
        assert got["saved_values"].abs().max() > 0  # the head had trained away from its zero init
        # ... and, with the optimizer, scheduler and RNG state, the same updates, bit for bit.
        assert got["resumed_history"] == got["history"][jobs.SAVE_AT:]
        assert got["trainer_state"] == {"data_position": 5, "global_step": jobs.SAVE_AT}
    exported, resumed = critic_runs[layout][0][arch]["final"], critic_runs[layout][0][arch]["resumed_final"]
    assert set(exported) == set(resumed)
    for name, tensor in exported.items():
        assert torch.equal(tensor, resumed[name]), name


@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
def test_value_head_is_one_replicated_tensor_pair_in_the_checkpoint(critic_runs, megatron_models, layout):
    from transformers import AutoConfig

    tp, pp = layout
    hidden = AutoConfig.from_pretrained(megatron_models["llama"]).hidden_size
    for rank, got in enumerate(critic_runs[layout]):
        head = got["llama"]["head_sharded"]
        if rank // tp != pp - 1:  # not the last stage: no head
            assert head == {}
            continue
        tp_rank = rank % tp
        # Whole on every TP rank, TP rank 0 the main replica, and no LM-head shape leniency.
        assert head == {"output_layer.weight": ("output_layer.weight", (1, hidden), (0, tp_rank, 0), False),
                        "output_layer.bias": ("output_layer.bias", (1,), (0, tp_rank, 0), False)}


@pytest.mark.parametrize("arch", ARCHS)
def test_critic_checkpoint_loads_at_another_layout(critic_runs, arch):
    saved = critic_runs[(2, 1)][0][arch]["saved_values"]
    for rank in critic_runs[(1, 2)]:
        assert (rank[arch]["values_from_other_layout"] - saved).abs().max().item() <= RESHARD_TOL


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=_layout_id)
def test_critic_exports_as_hf_token_classification(critic_runs, megatron_models, arch, layout):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForTokenClassification

    first, *others = critic_runs[layout]
    exported = first[arch]["final"]
    assert all(not rank[arch]["final"] for rank in others)  # gathered to the first rank alone
    policy = load_file(os.path.join(megatron_models[arch], "model.safetensors"))
    # The backbone under the policy's names, no LM head, and the value head as `score`.
    assert set(exported) == {k for k in policy if k != "lm_head.weight"} | {"score.weight", "score.bias"}
    assert exported["score.weight"].shape == (1, AutoConfig.from_pretrained(megatron_models[arch]).hidden_size)
    assert exported["score.bias"].shape == (1,)
    saved = first[arch]["saved_hf"]
    on_disk = {}
    for file in os.listdir(saved):
        if file.endswith(".safetensors"):
            on_disk.update(load_file(os.path.join(saved, file)))
    assert set(on_disk) == set(exported) and all(torch.equal(on_disk[k], v) for k, v in exported.items())
    model = AutoModelForTokenClassification.from_pretrained(saved, dtype=torch.float32).eval()
    assert model.config.num_labels == 1
    with torch.no_grad():
        out = model(jobs.tokens(model.config.vocab_size)).logits[..., 0]
    assert (out - first[arch]["final_head_out"]).abs().max().item() <= HF_TOL
