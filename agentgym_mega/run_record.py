"""What a training run leaves for people to read, kept by the driver alone: its resolved config
(`config.yaml`), metrics (JSONL, TensorBoard and, with logging.wandb, Weights & Biases), and its
episodes as text (agentgym_mega.episodes). Trainer ranks and engines never write any of it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from agentgym_mega import files
from agentgym_mega.config import dump_yaml, to_dict
from agentgym_mega.episodes import EpisodeWriter, episode_line
from agentgym_mega.metrics import MetricsLogger
from agentgym_mega.wandb_run import WandbRun

if TYPE_CHECKING:
    from agentgym_mega.config import Config

WANDB_EPISODES = 20  # episodes per step in the W&B table: a sample; the files hold all that are saved


class RunRecord:
    """`episodes(step, split, episodes)` as they come; `evaluated(step, report, episodes)` for
    each evaluation; `log(step, metrics)` once a step is done, which also hands the step's episodes to
    their writer; `close()` at the end."""

    def __init__(self, cfg: Config, resume: bool):
        out = cfg.trainer.output_dir
        os.makedirs(out, exist_ok=True)
        files.write_text_atomic(os.path.join(out, "config.yaml"), dump_yaml(cfg))
        self.env = cfg.env.name
        self.metrics = MetricsLogger(out, cfg.logging)
        self.writer = EpisodeWriter(out, cfg.logging.episodes, cfg.env.name)
        self.wandb = WandbRun.start(out, cfg.logging.wandb, to_dict(cfg), resume)
        self._wandb_episodes: dict[int, list] = {}

    def episodes(self, step: int, split: str, episodes: list) -> None:
        self.writer.add(step, split, episodes)
        if self.wandb:  # W&B's table takes a sample of them, spread over the step's episodes
            self._wandb_episodes.setdefault(step, []).extend(episode_line(e, step, split, self.env) for e in episodes)

    def evaluated(self, step: int, report: dict, episodes: list) -> None:
        """An evaluation's report and episodes (evaluation.Evaluator's `keep`)."""
        self.episodes(step, "eval", episodes)
        if self.wandb:
            self.wandb.log_eval(step, report)

    def log(self, step: int, metrics: dict) -> None:
        self.writer.flush(step)
        # the writer thread's seconds so far, what saving episodes has cost (off the training path)
        metrics = metrics | {"episodes/write_s_total": self.writer.write_s}
        self.metrics.log(step, metrics)
        if self.wandb:
            self.wandb.log(step, metrics)
            if self._wandb_episodes.get(step):
                self.wandb.log_episodes(step, self._wandb_episodes.pop(step), WANDB_EPISODES)

    def close(self) -> None:
        self.writer.close()
        self.metrics.close()
        if self.wandb:
            self.wandb.finish()
