"""megatron-core trains on 2 CPU ranks over gloo through the platform layer (TP=2, PP=2, DP=2),
with megatron's DDP, distributed optimizer, grad clipping and pipeline schedules."""

import pytest

from agentgym_mega.doctor import run_megatron_check

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (1, 1)], ids=["tp2", "pp2", "dp2"])
def test_tiny_gpt_trains_on_two_gloo_ranks(tp, pp):
    ranks = run_megatron_check(world=2, tp=tp, pp=pp, steps=6)
    first, second = ranks
    assert (first.tp, first.pp, first.dp) == (tp, pp, 2 // (tp * pp))
    assert "DistributedOptimizer" in first.optimizer
    # Every rank reports the same global loss: TP ranks compute it redundantly, PP and DP
    # ranks receive it through the all-reduce; bitwise equality is expected on CPU.
    assert first.losses == second.losses
    assert first.grad_norms == second.grad_norms
    losses = first.losses
    assert losses[0] == pytest.approx(4.85, abs=0.15)  # ~ln(128): a random init over 128 tokens
    assert losses[-1] < losses[0] - 0.1, losses
    # Grad clipping at 1.0 acted: norms above it before the step, at most 1.0 after clipping,
    # while norms already below the threshold were left alone.
    assert max(first.grad_norms) > 1.5
    for before, after in zip(first.grad_norms, first.clipped_norms):
        assert after == pytest.approx(min(before, 1.0), rel=1e-4)
