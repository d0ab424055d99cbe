"""The megatron-core actor and critic against Hugging Face transformers on 2 gloo ranks (fp32, CPU).

Launches (each runs several checks, see megatron_jobs.py): one TP=2 training job that saves a
checkpoint and resumes from it; one process killed in the middle of a later save; then one
parity job per layout (TP,PP) = (2,1), (1,2), (1,1), each also loading the TP=2 checkpoint.
"""

import os
import subprocess
import sys

import pytest
import torch

from agentgym_mega.platform.local_ranks import run_on_local_ranks
from tests.conftest import REPO
from tests.distributed import megatron_jobs as jobs

pytestmark = pytest.mark.slow

LOGIT_TOL = 1e-4  # max |logit / log-prob / entropy difference| to transformers, fp32
RESHARD_TOL = 1e-5  # same weights at another TP/PP layout: only the reduction order differs
LAYOUTS = [(2, 1), (1, 2), (1, 1)]
ARCHS = ["qwen2", "llama"]


@pytest.fixture(scope="module")
def hf_reference(megatron_models):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = {}
    for arch, path in megatron_models.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ids = jobs.tokens(model.config.vocab_size)
        with torch.no_grad():
            logits = model(ids).logits
        out[arch] = {"logits": logits, "ids": ids, "tensors": load_file(os.path.join(path, "model.safetensors"))}
    return out


@pytest.fixture(scope="module")
def runs(megatron_models, tmp_path_factory):
    work = tmp_path_factory.mktemp("megatron-runs")
    ckpt = str(work / "ckpt")
    training = run_on_local_ranks(jobs.training_job, 2, megatron_models, ckpt)
    killed = subprocess.run(
        [sys.executable, "-m", "tests.distributed.megatron_jobs", megatron_models["llama"],
         os.path.join(ckpt, "llama")],
        cwd=REPO, capture_output=True, text=True, timeout=300, start_new_session=True,
    )
    parity = {
        (tp, pp): run_on_local_ranks(jobs.parity_job, tp * pp, tp, pp, tp * pp, megatron_models, str(work), ckpt)
        for tp, pp in LAYOUTS
    }
    return {"training": training, "killed": killed, "parity": parity, "ckpt": ckpt}


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"tp{layout[0]}pp{layout[1]}")
def test_logits_logprobs_and_entropy_match_transformers(runs, hf_reference, arch, layout):
    ref = hf_reference[arch]
    logp_ref = torch.log_softmax(ref["logits"], -1)
    token_logp = logp_ref[:, :-1].gather(-1, ref["ids"][:, 1:, None]).squeeze(-1)
    entropy = -(logp_ref.exp() * logp_ref).sum(-1)[:, :-1]
    logp_t2 = torch.log_softmax(ref["logits"] / 2.0, -1)[:, :-1].gather(-1, ref["ids"][:, 1:, None]).squeeze(-1)
    for rank in runs["parity"][layout]:  # every rank returns the same results
        got = rank[arch]
        assert got["logits"].shape == ref["logits"].shape  # padded vocabulary rows dropped
        assert _max_diff(got["logits"], ref["logits"]) <= LOGIT_TOL
        assert torch.all(got["logprobs"][:, 0] == 0)
        assert _max_diff(got["logprobs"][:, 1:], token_logp) <= LOGIT_TOL
        assert _max_diff(got["entropy"][:, 1:], entropy) <= LOGIT_TOL
        assert _max_diff(got["logprobs_t2"][:, 1:], logp_t2) <= LOGIT_TOL
        # at chosen positions only (the LM head run on their rows alone): the same there, 0 elsewhere
        at = jobs.some_positions(ref["ids"]).bool()
        for key, want in (("logprobs", token_logp), ("entropy", entropy)):
            assert _max_diff(got["at_positions"][key], torch.nn.functional.pad(want, (1, 0)) * at) <= LOGIT_TOL
            assert torch.all(got["at_positions"][key][~at] == 0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"tp{layout[0]}pp{layout[1]}")
def test_hf_megatron_hf_round_trip_is_bitwise(runs, hf_reference, arch, layout):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    original = hf_reference[arch]["tensors"]
    first, *others = (rank[arch]["exported"] for rank in runs["parity"][layout])
    assert set(first) == set(original)
    for name, tensor in original.items():
        assert torch.equal(first[name], tensor), name
    assert all(not exported for exported in others)  # gathered to the first rank alone
    saved = runs["parity"][layout][0][arch]["saved_hf"]
    on_disk = {}
    for file in os.listdir(saved):
        if file.endswith(".safetensors"):
            on_disk.update(load_file(os.path.join(saved, file)))
    assert set(on_disk) == set(original) and all(torch.equal(on_disk[k], v) for k, v in original.items())
    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(reloaded(hf_reference[arch]["ids"]).logits, hf_reference[arch]["logits"])
    assert os.path.exists(os.path.join(saved, "tokenizer.json"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: f"tp{layout[0]}pp{layout[1]}")
def test_export_to_each_stage_and_to_every_rank(runs, hf_reference, arch, layout):
    # "stage": the first TP rank of each stage yields its own stage's tensors, together all of
    # them once; "every": every rank yields the whole model (TP all-gathered, stages broadcast)
    tp, pp = layout
    original = hf_reference[arch]["tensors"]
    ranks = runs["parity"][layout]
    by_stage = [rank[arch]["exported_stage"] for rank in ranks]
    senders = [exported for exported in by_stage if exported]
    assert len(senders) == pp and all(not by_stage[r] for r in range(len(ranks)) if r % tp)
    assert sorted(name for exported in senders for name in exported) == sorted(original)
    for exported in senders:
        assert all(torch.equal(tensor, original[name]) for name, tensor in exported.items())
    for rank in ranks:
        every = rank[arch]["exported_every"]
        assert set(every) == set(original) and all(torch.equal(every[k], v) for k, v in original.items())


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_saved_at_tp2_loads_at_other_layouts(runs, arch):
    saved = runs["training"][0][arch]["saved_logits"]  # TP=2, right after loading the checkpoint
    for layout in LAYOUTS:
        for rank in runs["parity"][layout]:
            loaded = rank[arch]["loaded_logits"]
            tol = 0.0 if layout == (2, 1) else RESHARD_TOL
            assert _max_diff(loaded, saved) <= tol, layout


@pytest.mark.parametrize("arch", ARCHS)
def test_an_update_computes_the_same_loss_and_grad_norm_at_every_layout(runs, arch):
    # After loading the same checkpoint: DDP + distributed optimizer through the pipeline
    # schedule at (2,1), (1,2) and (1,1) see the same loss and gradient norm.
    updates = [rank[arch]["update"] for ranks in runs["parity"].values() for rank in ranks]
    for update in updates:
        assert update["loss"] == pytest.approx(updates[0]["loss"], rel=RESHARD_TOL)
        assert update["grad_norm"] == pytest.approx(updates[0]["grad_norm"], rel=1e-4)


def test_killed_save_leaves_previous_checkpoint_loadable(runs):
    root = os.path.join(runs["ckpt"], "llama")
    assert runs["killed"].returncode == -9, runs["killed"].stderr[-3000:]
    assert os.listdir(os.path.join(root, "iter_0000003.tmp"))  # it had written shards
    assert not os.path.exists(os.path.join(root, "iter_0000003"))
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == "iter_0000002"
    # The parity jobs, which ran after the kill, loaded `latest` at every layout
    # (test_checkpoint_saved_at_tp2_loads_at_other_layouts checks what they got).
    assert all("loaded_logits" in rank["llama"] for ranks in runs["parity"].values() for rank in ranks)


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_training_clips_reduces_loss_and_resumes_bitwise(runs, arch):
    first, second = (rank[arch] for rank in runs["training"])
    history = first["history"]
    assert first["history"] == second["history"]  # both TP ranks report the same step metrics
    losses = [h["loss"] for h in history]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert history[0]["grad_norm"] > 0.5  # above trainer.grad_clip: clipping acted
    assert history[0]["lr"] == pytest.approx(3e-3) and history[-1]["lr"] < history[1]["lr"]  # cosine
    # Resumed from the checkpoint at step 2: the same metrics and the same weights, bit for bit.
    assert first["resumed_history"] == history[jobs.SAVE_AT:]
    assert set(first["final"]) == set(first["resumed_final"])
    for name, tensor in first["final"].items():
        assert torch.equal(tensor, first["resumed_final"][name]), name
    # Full activation recompute changes memory, not results.
    assert first["recompute_history"] == history[: jobs.SAVE_AT]
    assert first["trainer_state"] == {"horizon_stage": 1, "data_position": 17, "global_step": jobs.SAVE_AT}


@pytest.mark.parametrize("arch", ARCHS)
def test_critic_starts_at_zero_and_fits_returns(runs, arch):
    got = runs["training"][0][arch]
    assert torch.all(got["values_before"] == 0)  # the value head starts at zero
    losses = got["critic_losses"]
    assert losses[-1] < losses[0]
    assert got["values_after"].abs().max() > 0
