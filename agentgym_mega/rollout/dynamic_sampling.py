"""A step's rollout batch, with DAPO's dynamic sampling when `rollout.dynamic_sampling` is on.

GRPO and RLOO learn nothing from a group whose samples all scored the same: its advantages are
zero. Dynamic sampling draws tasks in waves and keeps the groups with spread until the batch
holds `trainer.batch_size` of them, drawing at most `dynamic_sampling_max_draws` times that many
groups; short of it, the batch is filled with the first flat groups drawn. Each wave's size
follows from the share of groups with spread so far, so the draws (and the task sampler's
position, which checkpoints keep) depend only on the episodes, never on timing: a resumed run
draws what the uninterrupted one drew.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from agentgym_mega.rollout.batch import TrajectoryBatch

if TYPE_CHECKING:
    from agentgym_mega.config import Config


def groups_with_spread(batch: TrajectoryBatch) -> set[int]:
    """Group ids whose trained samples (at least two) did not all score the same."""
    scores: dict[int, list[float]] = {}
    for group, episode in zip(batch.group_ids.tolist(), batch.episodes):
        if episode.trained:
            scores.setdefault(group, []).append(episode.score)
    return {g for g, s in scores.items() if len(s) >= 2 and max(s) > min(s)}


def _groups(batch: TrajectoryBatch) -> list[TrajectoryBatch]:
    """The batch's groups, in order of first appearance, each as its own batch."""
    rows: dict[int, list[int]] = {}
    for row, group in enumerate(batch.group_ids.tolist()):
        rows.setdefault(group, []).append(row)
    return [batch.select(r) for r in rows.values()]


def _numbered(groups: list[TrajectoryBatch], pad_id: int) -> TrajectoryBatch:
    """The groups as one batch, group ids renumbered 0..len(groups)-1 in order."""
    batch = TrajectoryBatch.concat(groups, pad_id)
    sizes = [len(g) for g in groups]
    ids = [g for g, size in enumerate(sizes) for _ in range(size)]
    batch.group_ids = batch.group_ids.new_tensor(ids)
    batch.episodes = [dataclasses.replace(e, group_id=g) for e, g in zip(batch.episodes, ids)]
    return batch


def collect_batch(rollout, sampler, cfg: Config, step: int, max_turns: int) -> tuple[TrajectoryBatch, dict]:
    """The step's batch of trainer.batch_size groups and the rollout's metrics (timings, and with
    dynamic sampling the groups drawn, dropped and kept flat)."""
    seed = (cfg.trainer.seed, step) if cfg.rollout.seeded else None
    want, n = cfg.trainer.batch_size, cfg.rollout.n_per_task
    if not cfg.rollout.dynamic_sampling:
        batch = rollout.collect(sampler.next(want), n, max_turns, seed=seed)
        return batch, dict(rollout.timings)
    limit = math.floor(cfg.rollout.dynamic_sampling_max_draws * want)
    spread: list[TrajectoryBatch] = []
    flat: list[TrajectoryBatch] = []
    timings: dict[str, float] = {}
    drawn = waves = 0
    while len(spread) < want and drawn < limit:
        need = want - len(spread)
        rate = len(spread) / drawn if drawn else 1.0
        size = min(limit - drawn, math.ceil(need / rate) if rate else limit - drawn)
        wave_seed = seed if seed is None or waves == 0 else (*seed, waves)
        batch = rollout.collect(sampler.next(size), n, max_turns, seed=wave_seed)
        keep = groups_with_spread(batch)
        for group in _groups(batch):
            (spread if int(group.group_ids[0]) in keep else flat).append(group)
        for key, value in rollout.timings.items():
            timings[key] = timings.get(key, 0.0) + value
        drawn += size
        waves += 1
    short = max(0, want - len(spread))
    batch = _numbered(spread[:want] + flat[:short], rollout.tokenizer.pad_token_id or 0)
    busy = timings.pop("rollout/engine_busy_fraction", 0.0) / waves  # each wave's share, averaged
    return batch, timings | {"rollout/engine_busy_fraction": busy, "rollout/groups_drawn": drawn,
                             "rollout/groups_dropped": drawn - want, "rollout/groups_flat_kept": short,
                             "rollout/waves": waves}
