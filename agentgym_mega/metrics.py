"""Run metrics: one JSONL line and TensorBoard scalars per step, and episode statistics."""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager


def episode_metrics(batch) -> dict:
    """Reward, success, turns, lengths and how episodes ended, over a rollout batch."""
    episodes = batch.episodes
    n = max(1, len(episodes))
    count = lambda status: sum(e.status == status for e in episodes)  # noqa: E731
    return {
        "reward/mean": sum(e.score for e in episodes) / n,
        "reward/success_rate": sum(e.score > 0 for e in episodes) / n,
        "episode/turns_mean": sum(e.turns for e in episodes) / n,
        "episode/response_tokens_mean": sum(e.response_tokens for e in episodes) / n,
        "episode/done": count("done"),
        "episode/horizon": count("horizon"),
        "episode/truncated": count("truncated"),
        "episode/env_errors": count("env_error"),
    }


class Timer:
    """Wall-clock seconds per phase of a step: `with timer("generate"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict:
        return {f"time/{k}_s": v for k, v in self.seconds.items()}


class MetricsLogger:
    def __init__(self, output_dir: str, logging_cfg):
        os.makedirs(output_dir, exist_ok=True)
        self.jsonl = open(os.path.join(output_dir, "metrics.jsonl"), "a") if logging_cfg.jsonl else None
        self.tb = None
        if logging_cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))

    def log(self, step: int, metrics: dict) -> None:
        if self.jsonl:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()
        if self.tb:
            for key, value in metrics.items():
                if isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()

    def close(self) -> None:
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
