"""bench rollout's stated env latency: what both modes meet must be the same draw per (episode,
turn), log-normal around the stated median, and never past the cap."""

import statistics

from agentgym_mega.bench.rollout import LATENCY_CAP_S, DelayedEnv


def test_latency_is_a_seeded_lognormal_with_the_stated_median_and_cap():
    env = DelayedEnv(["http://127.0.0.1:1"], median_s=0.04)
    draws = [env.latency(e, t) for e in range(200) for t in range(1, 11)]
    assert draws == [env.latency(e, t) for e in range(200) for t in range(1, 11)]  # the same in every mode
    assert abs(statistics.median(draws) - 0.04) < 0.004
    assert max(draws) <= LATENCY_CAP_S and min(draws) > 0
    assert statistics.quantiles(draws, n=10)[-1] > 2.5 * 0.04  # a long tail: p90 = e^1.28 x the median
    assert DelayedEnv(["http://127.0.0.1:1"], median_s=0.04, seed=1).latency(0, 1) != env.latency(0, 1)
    assert DelayedEnv(["http://127.0.0.1:1"], median_s=0.0).latency(3, 2) == 0.0
