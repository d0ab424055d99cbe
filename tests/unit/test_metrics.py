"""Step metrics from a rollout batch, and the reward-curve plot a run ends with."""

import json
from types import SimpleNamespace

import torch

from agentgym_mega.metrics import MetricsLogger, episode_metrics, plot_rewards
from agentgym_mega.rollout.batch import Episode
from agentgym_mega.rollout.status import Status


def test_episode_metrics_count_outcomes_and_groups_with_spread():
    # task 1's env error, had it counted, would be a sample scoring 1.0 (a spread) and a success
    episodes = [Episode(0, "a", 0, 1.0, True, 2, Status.DONE, 5, valid_actions=1),
                Episode(0, "a", 0, 0.5, False, 6, Status.HORIZON, 9, valid_actions=6),
                Episode(1, "a", 1, 0.0, False, 6, Status.HORIZON, 9, valid_actions=0),
                Episode(1, "a", 1, 1.0, True, 1, Status.ENV_ERROR, 0, "boom", valid_actions=1)]

    class Batch:
        pass

    batch = Batch()
    batch.episodes, batch.group_ids = episodes, torch.tensor([0, 0, 1, 1])
    m = episode_metrics(batch)
    # over the three episodes without an env error; success is the env's verdict, not score > 0
    assert m["reward/mean"] == 0.5 and m["reward/success_rate"] == 1 / 3
    assert m["reward/groups_with_spread"] == 0.5  # task 0's samples differ, task 1's valid one alone
    assert m["episode/valid_action_rate"] == 7 / 14  # replies parsed as actions over the three episodes' 14
    assert (m["episode/done"], m["episode/horizon"], m["episode/env_errors"]) == (1, 2, 1)
    assert m["episode/turns_mean"] == 15 / 4


def test_reward_std_spreads_the_trained_episodes_scores_only():
    class Batch:
        pass

    batch = Batch()
    # the env error's 1.0, were it counted, would move the std; ddof 0: the step's own spread
    batch.episodes = [Episode(0, "a", 0, score, True, 1, Status.DONE, 3) for score in (0.0, 0.5, 1.0)]
    batch.episodes.append(Episode(1, "a", 1, 1.0, True, 1, Status.ENV_ERROR, 0, "boom"))
    assert abs(episode_metrics(batch)["reward/std"] - (1 / 6) ** 0.5) < 1e-12
    batch.episodes = batch.episodes[:1]
    assert episode_metrics(batch)["reward/std"] == 0.0  # one episode: no spread
    batch.episodes = []
    assert episode_metrics(batch)["reward/std"] == 0.0  # nothing trained on


def test_reward_curve_is_written_from_metrics_with_evals_and_a_resumed_step(tmp_path):
    lines = [{"step": 0, "eval/success": 0.3}]
    lines += [{"step": s, "reward/mean": s / 10, "reward/success_rate": s / 10, "horizon/turn_cap": 2 if s < 4 else 4}
              for s in range(1, 7)]
    lines += [{"step": 6, "reward/mean": 0.7, "reward/success_rate": 0.7, "horizon/turn_cap": 4, "eval/success": 0.8}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    path = plot_rewards(str(tmp_path), "a run", window=3)
    assert path == str(tmp_path / "reward_curve.png")
    data = (tmp_path / "reward_curve.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_metrics_jsonl_appears_with_its_first_line(tmp_path):
    """Launchers and tests take an existing metrics.jsonl as the sign that a step was logged: the
    logger made at a run's start must not create it empty."""
    logger = MetricsLogger(str(tmp_path), SimpleNamespace(jsonl=True, tensorboard=False))
    assert not (tmp_path / "metrics.jsonl").exists()
    logger.log(1, {"reward/mean": 0.5})
    logger.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "reward/mean": 0.5}\n'
