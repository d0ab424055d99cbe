"""Weights & Biases beside TensorBoard (logging.wandb): step metrics, eval tables and a sample of
episodes, in one W&B run per run directory that a resumed run continues.

Only the driver creates a WandbRun (the trainer, once per run): ranks and engines never import
wandb, so one W&B run holds everything and no worker starts W&B's service process.

- The x axis is the metric `trainer/step`, logged in every row (define_metric("*", step_metric=...)),
  not wandb's own `_step`: wandb drops a row whose `step=` is below the run's current step, which a
  resumed run redoing steps after its last checkpoint would hit. Its rows are appended; plots by
  trainer/step show the redone steps where they belong.
- The run id is kept in RUN/wandb_run_id. A resumed run (resume=True and that file) calls
  wandb.init(id=..., resume="allow"): online it continues the run on the server (or creates it, when
  an earlier offline run was never synced); offline, wandb 0.31 writes a new directory
  RUN/wandb/offline-run-<time>-<id>[-k] for the same run id, marked resumed, whose `_step` starts
  at 0 again; `wandb sync RUN/wandb/offline-run-*` uploads the directories of one run in order of
  start time. A run that is not resumed starts a new W&B run and replaces the id.
- wandb does not touch the console (console="off": the trainer's tqdm bar and output stay as they
  are; no SIGWINCH handler) nor sample system metrics (x_disable_stats: no monitor process taking
  CPU beside the trainer). It wraps sys.exit and sys.excepthook (chaining to the originals) and
  installs no SIGTERM/SIGINT handler, so the trainer's own stop handling is unchanged.
"""

from __future__ import annotations

import os

from agentgym_mega import files
from agentgym_mega.errors import BadInput

ID_FILE = "wandb_run_id"
STEP_KEY = "trainer/step"
EVAL_COLUMNS = ("category", "tasks", "avg", "pass", "success", "valid")
EPISODE_COLUMNS = ("step", "split", "task_id", "category", "status", "score", "success", "turns", "text")
TEXT_LIMIT = 4000  # characters of an episode's conversation in its table cell


def _import_wandb():
    try:
        import wandb
    except ImportError as e:
        raise BadInput(f"logging.wandb.mode needs the wandb package ({e}): pip install 'agentgym-mega[wandb]', "
                       "or set logging.wandb.mode=disabled") from e
    return wandb


def episode_text(episode: dict, limit: int = TEXT_LIMIT) -> str:
    """An episode's conversation as plain text: the first observation, then per turn the reply,
    the parsed action (or why none parsed) and the env's answer; cut to `limit` characters."""
    lines = [f"observation: {episode.get('observation', '')}"]
    for i, turn in enumerate(episode.get("turns", []), 1):
        action = turn.get("action") or f"(none: {turn.get('action_error')})"
        lines += [f"--- turn {i} (reward {turn.get('reward')})", f"reply: {turn.get('text', '')}",
                  f"action: {action}"]
        if turn.get("observation") is not None:
            lines.append(f"observation: {turn['observation']}")
    text = "\n".join(lines)
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters]"


def sample_evenly(items: list, limit: int) -> list:
    """At most `limit` items spread over the list (every k-th), so a sample covers all its tasks."""
    if len(items) <= limit:
        return list(items)
    return [items[i * len(items) // limit] for i in range(limit)]


class WandbRun:
    """The driver's W&B run: `start` it (None when logging.wandb.mode is disabled), then `log`,
    `log_eval`, `log_episodes` per step, and `finish` at the end."""

    def __init__(self, wandb, run):
        self.wandb = wandb
        self.run = run

    @classmethod
    def start(cls, output_dir: str, wandb_cfg, run_config: dict, resume: bool) -> WandbRun | None:
        """Starts (or, with `resume` and RUN/wandb_run_id, continues) the W&B run of `output_dir`;
        its files go under output_dir/wandb. `run_config` (config.to_dict) becomes the run's config;
        the run's name is wandb_cfg.name, else logging.experiment."""
        if wandb_cfg.mode == "disabled":
            return None
        wandb = _import_wandb()
        os.makedirs(output_dir, exist_ok=True)
        id_path = os.path.join(output_dir, ID_FILE)
        run_id = None
        if resume and os.path.exists(id_path):
            with open(id_path) as f:
                run_id = f.read().strip() or None
        name = wandb_cfg.name or run_config.get("logging", {}).get("experiment")
        settings = wandb.Settings(console="off", x_disable_stats=True, quiet=True)
        try:
            run = wandb.init(project=wandb_cfg.project, entity=wandb_cfg.entity, name=name,
                             tags=list(wandb_cfg.tags), mode=wandb_cfg.mode, dir=output_dir, config=run_config,
                             id=run_id, resume="allow" if run_id else None, settings=settings)
        except wandb.errors.UsageError as e:  # online without a login, an entity or project it refuses
            raise BadInput(f"logging.wandb.mode={wandb_cfg.mode}: {e} (log in with `wandb login` or "
                           "WANDB_API_KEY, or run with logging.wandb.mode=offline and `wandb sync` later)") from e
        if run_id is None:
            files.write_text_atomic(id_path, run.id + "\n")
        run.define_metric(STEP_KEY)
        run.define_metric("*", step_metric=STEP_KEY)
        return cls(wandb, run)

    @property
    def id(self) -> str:
        return self.run.id

    def log(self, step: int, metrics: dict) -> None:
        """The step's numeric metrics (what TensorBoard gets), at x = step."""
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        self.run.log({STEP_KEY: step, **numeric})

    def log_eval(self, step: int, report: dict) -> None:
        """An evaluation report (eval/step_N.json) as the table `eval/table`: a row per category,
        then `overall`."""
        groups = [*sorted(report.get("categories", {}).items()), ("overall", report["overall"])]
        rows = [[category, *(values.get(key) for key in EVAL_COLUMNS[1:])] for category, values in groups]
        table = self.wandb.Table(columns=list(EVAL_COLUMNS), data=rows, allow_mixed_types=True)
        self.run.log({STEP_KEY: step, "eval/table": table})

    def log_episodes(self, step: int, episodes: list[dict], limit: int = 20) -> None:
        """Up to `limit` episodes (episodes/step_N.jsonl lines), spread over the list, as the table
        `episodes/sample`, with each conversation as text."""
        rows = [[e.get("step", step), e.get("split"), e.get("task_id"), e.get("category"), e.get("status"),
                 e.get("score"), e.get("success"), len(e.get("turns", [])), episode_text(e)]
                for e in sample_evenly(episodes, limit)]
        table = self.wandb.Table(columns=list(EPISODE_COLUMNS), data=rows, allow_mixed_types=True)
        self.run.log({STEP_KEY: step, "episodes/sample": table})

    def finish(self) -> None:
        self.run.finish()
