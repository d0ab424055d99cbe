"""Data parallelism slices the batch: DP=2 on 2 gloo ranks computes the same log-probs and
values as one rank, and one update on the same batch gives the same loss, gradient norm and
weights, with the loss normalised by the global count of trained tokens (or sequences).

The batch's two halves carry very different numbers of trained tokens (one sequence nearly
fully masked in, the other half sparse), so averaging per-rank means would give another update."""

import pytest
import torch

from agentgym_mega.platform.local_ranks import run_on_local_ranks
from tests.distributed import megatron_jobs as jobs

pytestmark = pytest.mark.slow

TOL = 1e-5  # fp32; only the order of the reductions differs between DP=1 and DP=2
AGGS = ["token-mean", "seq-mean-token-mean"]


@pytest.fixture(scope="module")
def runs(megatron_models):
    hf_dir = megatron_models["qwen2"]
    return {world: run_on_local_ranks(jobs.data_parallel_job, world, world, hf_dir, AGGS) for world in (1, 2)}


def _max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def test_dp2_log_probs_and_values_equal_one_rank(runs):
    single, (first, second) = runs[1][0], runs[2]
    for key in ("logprobs", "entropy", "values"):
        assert first[key].shape == single[key].shape
        assert _max_diff(first[key], single[key]) <= TOL, key
        assert torch.equal(first[key], second[key]), key  # every rank returns the whole batch


@pytest.mark.parametrize("agg", AGGS)
def test_dp2_update_equals_one_rank(runs, agg):
    single, ranks = runs[1][0][agg], [rank[agg] for rank in runs[2]]
    moved = max(_max_diff(single["after"][k], single["before"][k]) for k in single["after"])
    assert moved > 100 * TOL  # the step changed the weights by far more than the tolerance
    for rank in ranks:
        for key in ("loss", "pg_loss", "clip_fraction", "grad_norm"):
            assert rank["metrics"][key] == pytest.approx(single["metrics"][key], rel=TOL, abs=TOL), key
        assert max(_max_diff(rank["after"][k], single["after"][k]) for k in single["after"]) <= TOL
