"""Micro-batches change how a rank's share of a batch is run, never the update: one update of a
ragged batch cut into 1, 2 or 4 micro-batches of sequences, or into token-budget bins, gives the
same log-probs, loss, gradient norm and updated weights, at TP=2, PP=2 and DP=2. Each micro-batch
is only as wide as its longest sequence, so the comparison also covers the narrower widths.
(Sequence parallelism, whose widths round up to a multiple of TP, needs Transformer Engine: CPU
runs cannot have it; the rounding itself is tested in tests/unit/test_micro_batches.py.)
Megatron's schedule is handed the real number of micro-batches (PP=2: the 1F1B pipeline with 4).
Tolerance: relative and absolute 1e-5 (fp32; only the order of the reductions differs) for the
log-probs before, the loss, the gradient norm and the entropy. The log-probs after the update
get 1e-3: Adam's first step moves each weight by lr * g / (|g| + eps), so a gradient element
within rounding (~1e-8) of zero, which eps (1e-8) does not damp, can move anywhere in +-lr
(3e-3). Measured: the same gradients to 1e-8 gave log-probs after that differ by 4e-5 to 3e-4
depending only on how the head rounds, against an update that moves them by up to 5.7."""

import pytest
import torch

from agentgym_mega.models.micro_batches import token_bins
from agentgym_mega.platform.local_ranks import run_on_local_ranks
from tests.distributed import megatron_jobs as jobs

pytestmark = pytest.mark.slow

TOL = 1e-5
AFTER_TOL = 1e-3
LAYOUTS = {"tp1pp1": (1, 1, 1), "tp2": (2, 1, 2), "pp2": (1, 2, 2), "dp2": (1, 1, 2)}


@pytest.fixture(scope="module")
def runs(megatron_models):
    return {name: run_on_local_ranks(jobs.micro_batch_job, world, tp, pp, world, megatron_models["qwen2"])[0]
            for name, (tp, pp, world) in LAYOUTS.items()}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("way", ["4_per_micro", "2_per_micro", "tokens_48"])
def test_update_in_micro_batches_equals_one_micro_batch(runs, layout, way):
    one, cut = runs[layout]["one"], runs[layout][way]
    for key, tol in (("before", TOL), ("after", AFTER_TOL)):
        assert torch.allclose(cut[key], one[key], rtol=tol, atol=tol), (key, (cut[key] - one[key]).abs().max())
    for key in ("loss", "grad_norm", "entropy"):
        assert cut["metrics"][key] == pytest.approx(one["metrics"][key], abs=TOL, rel=TOL), key
    assert (one["after"] - one["before"]).abs().max().item() > 1.0  # the update moved the policy, far past AFTER_TOL


def test_the_schedule_gets_the_real_number_of_micro_batches(runs):
    for layout in LAYOUTS:
        slice_size = len(jobs.LENGTHS) // (2 if layout == "dp2" else 1)
        for way, per_micro in (("one", slice_size), ("4_per_micro", 4), ("2_per_micro", 2)):
            expected = -(-slice_size // per_micro)
            assert {n for _, n in runs[layout][way]["schedules"]} == {expected}, (layout, way)
    names = {name for name, _ in runs["pp2"]["2_per_micro"]["schedules"]}
    assert names == {"forward_backward_pipelining_without_interleaving"}
    assert {n for _, n in runs["pp2"]["2_per_micro"]["schedules"]} == {4}
    assert {name for name, _ in runs["tp1pp1"]["one"]["schedules"]} == {"forward_backward_no_pipelining"}


def test_token_bins_stay_within_the_budget_and_agree_across_dp(runs):
    # 8 sequences, 120 real tokens, budget 48 padded tokens: at least 3 bins
    assert {n for _, n in runs["tp1pp1"]["tokens_48"]["schedules"]} == {len(token_bins(jobs.LENGTHS, 48))}
    # DP=2: each rank's half is binned on its own, then both run the larger count
    halves = [token_bins(jobs.LENGTHS[:4], 48), token_bins(jobs.LENGTHS[4:], 48)]
    assert {n for _, n in runs["dp2"]["tokens_48"]["schedules"]} == {max(map(len, halves))}
