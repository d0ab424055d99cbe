"""Dynamic sampling's choices, against hand-computed draws: which groups a step keeps, how many
it draws in which waves, what it reports, and that the draws repeat (exact resume). The rollout
here returns real TrajectoryBatch records whose scores the test chooses per task;
tests/e2e/test_rollout_manager.py runs the same function through vLLM and env servers."""

import torch

from agentgym_mega.config import load_config
from agentgym_mega.rollout.batch import Episode, TrajectoryBatch
from agentgym_mega.rollout.dynamic_sampling import collect_batch, groups_with_spread
from agentgym_mega.rollout.status import Status
from agentgym_mega.rollout.tasks import TaskSampler
from envs.environment import Task


def _batch(scores: list[list[float]], task_ids: list[int], statuses=None) -> TrajectoryBatch:
    """One group per task: its samples' scores; row r's tokens are [task id, r, ...] of width 2 + r % 3."""
    rows = [(g, s) for g, group in enumerate(scores) for s in group]
    width = 2 + max(r % 3 for r in range(len(rows)))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (g, _) in enumerate(rows):
        ids[r, : 2 + r % 3] = torch.tensor([task_ids[g], r] + [7] * (r % 3))
    statuses = statuses or [Status.DONE] * len(rows)
    return TrajectoryBatch(
        input_ids=ids, attention_mask=(ids != 0).long(), loss_mask=torch.ones(len(rows), width),
        rollout_logprobs=torch.zeros(len(rows), width), rewards=torch.zeros(len(rows), width),
        group_ids=torch.tensor([g for g, _ in rows]), scores=torch.tensor([s for _, s in rows]),
        episodes=[Episode(task_ids[g], "", g, s, s > 0, 1, status, 1) for (g, s), status in zip(rows, statuses)])


class ScoredRollout:
    """Episodes scored by task: task t's samples score SCORES[t] (flat when all equal)."""

    def __init__(self, scores: dict[int, list[float]]):
        self.scores, self.calls, self.timings = scores, [], {}
        self.tokenizer = type("Tok", (), {"pad_token_id": 0})()

    def collect(self, tasks, n, max_turns, seed=None):
        self.calls.append(([t.id for t in tasks], seed))
        self.timings = {"time/generate_s": 1.0, "time/env_s": 0.5, "rollout/engine_busy_fraction": 0.5}
        return _batch([self.scores[t.id][:n] for t in tasks], [t.id for t in tasks])


def cfg(*overrides):
    return load_config(None, ["rollout.n_per_task=2", "trainer.batch_size=4", "trainer.mini_batch_size=1",
                              "rollout.dynamic_sampling=true", *overrides])


def test_groups_with_spread_counts_trained_samples_only():
    batch = _batch([[0, 1], [1, 1], [0.5, 0.5], [0, 1]], [1, 2, 3, 4],
                   statuses=[Status.DONE] * 7 + [Status.ENV_ERROR])
    assert groups_with_spread(batch) == {0}  # group 3's spread came from an untrained sample


def test_waves_follow_the_share_with_spread_and_keep_draw_order():
    order = [t.id for t in TaskSampler([Task(t) for t in range(40)], seed=0).next(40)]
    spread_at = {1, 5, 6, 7, 12, 13}  # positions in the draw order
    rollout = ScoredRollout({t: [0.0, 1.0] if p in spread_at else [0.0, 0.0] for p, t in enumerate(order)})
    sampler = TaskSampler([Task(t) for t in range(40)], seed=0)
    batch, metrics = collect_batch(rollout, sampler, cfg("rollout.dynamic_sampling_max_draws=5"), 3, 2)
    # Wave 1: 4 tasks, 1 with spread (a share of 1/4); wave 2: the 3 missing / (1/4) = 12 tasks,
    # which hold 5 more. 16 drawn (of at most 20), the first 4 with spread kept, 12 dropped.
    assert rollout.calls == [(order[:4], (0, 3)), (order[4:16], (0, 3, 1))]
    assert [e.task_id for e in batch.episodes[::2]] == [order[p] for p in (1, 5, 6, 7)]
    assert (metrics["rollout/groups_drawn"], metrics["rollout/groups_dropped"], metrics["rollout/waves"]) == (16, 12, 2)
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [e.group_id for e in batch.episodes] == batch.group_ids.tolist()
    assert metrics["rollout/groups_flat_kept"] == 0 and sampler.position == metrics["rollout/groups_drawn"]
    assert metrics["rollout/groups_dropped"] == metrics["rollout/groups_drawn"] - 4
    assert metrics["time/generate_s"] == metrics["rollout/waves"] * 1.0
    assert metrics["rollout/engine_busy_fraction"] == 0.5
    # Rows keep their own tokens through the regrouping (padding to the widest wave).
    for row, episode in enumerate(batch.episodes):
        assert int(batch.input_ids[row, 0]) == episode.task_id


def test_short_of_spread_the_draws_stop_at_the_limit_and_flat_groups_fill_in_draw_order():
    rollout = ScoredRollout({t: [0.0, 1.0] if t == 5 else [1.0, 1.0] for t in range(40)})
    sampler = TaskSampler([Task(t) for t in range(40)], seed=1)
    order = [t.id for t in TaskSampler([Task(t) for t in range(40)], seed=1).next(40)]
    batch, metrics = collect_batch(rollout, sampler, cfg("rollout.dynamic_sampling_max_draws=2.5"), 1, 2)
    assert metrics["rollout/groups_drawn"] == 10 == sampler.position  # floor(2.5 * 4)
    spread = [t for t in order[:10] if t == 5]
    assert [e.task_id for e in batch.episodes[::2]] == spread + [t for t in order[:10] if t != 5][: 4 - len(spread)]
    assert metrics["rollout/groups_flat_kept"] == 4 - len(spread) and metrics["rollout/groups_dropped"] == 6


def test_the_same_step_draws_the_same_and_without_it_one_plain_collect():
    scores = {t: [float(t % 2), float(t % 4 == 1)] for t in range(40)}
    runs = []
    for _ in range(2):
        rollout, sampler = ScoredRollout(scores), TaskSampler([Task(t) for t in range(40)], seed=2, position=7)
        batch, _ = collect_batch(rollout, sampler, cfg(), 9, 3)
        runs.append((rollout.calls, sampler.position, batch.input_ids))
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1] and torch.equal(runs[0][2], runs[1][2])

    rollout, sampler = ScoredRollout(scores), TaskSampler([Task(t) for t in range(40)], seed=2)
    batch, metrics = collect_batch(rollout, sampler, cfg("rollout.dynamic_sampling=false"), 9, 3)
    assert len(rollout.calls) == 1 and sampler.position == 4 and len(batch) == 8
    assert "rollout/groups_drawn" not in metrics and metrics["time/generate_s"] == 1.0
