"""`agentgym-mega bench learn`: does an estimator learn? The CPU demo's task (configs/demo_cpu.yaml:
three BabyAI levels, the tiny base policy, a ScalingInter horizon) trained with the chosen
estimator, reporting held-out success at the start and at the end.

The demo's schedule is kept in proportion when `--steps` shortens the run: the turn cap steps
through its three stages at the same fractions of the run, and evaluations come at each quarter.
The base policy is pretrained first when it is missing (as `make demo` does).
"""

from __future__ import annotations

import json
import os

from agentgym_mega.config import Config, load_config

DEMO_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "demo_cpu.yaml")
DEMO_STEPS = 160  # the demo's length, which its horizon interval and eval frequency are set for


def overrides(estimator: str, steps: int, output_dir: str) -> list[str]:
    """The demo config's settings for `estimator` over `steps` steps."""
    demo = load_config(DEMO_CONFIG)
    scale = steps / DEMO_STEPS
    return [f"algorithm.estimator={estimator}", f"trainer.total_steps={steps}",
            f"horizon.interval={max(1, round(demo.horizon.interval * scale))}",
            f"eval.freq={max(1, round(demo.eval.freq * scale))}", "eval.at_start=true",
            f"trainer.save_freq={steps}", f"trainer.output_dir={output_dir}"]


def ensure_base(cfg: Config) -> None:
    if os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        return
    from agentgym_mega import cli

    code = cli.main(["pretrain-tiny", "--env", cfg.env.name, "--categories", ",".join(cfg.env.categories),
                     "--out", cfg.model.path])
    if code:
        raise RuntimeError(f"pretraining the base policy into {cfg.model.path} failed (exit {code})")


# A step's phases as the trainer times them (time/generate_s and time/env_s are parts of rollout).
STEP_PHASES = ("rollout", "logprob", "values", "train", "rollout_wait", "sync")


def run(estimator: str, steps: int, output_dir: str, settings: list[str] | None = None) -> dict:
    """`settings`: more config overrides (e.g. rollout.mode=async), applied last."""
    from agentgym_mega.trainer import train

    cfg = load_config(DEMO_CONFIG, overrides(estimator, steps, output_dir) + list(settings or []))
    ensure_base(cfg)
    if os.path.exists(os.path.join(output_dir, "metrics.jsonl")):
        raise RuntimeError(f"{output_dir} already holds a run: remove it or pass --output-dir")
    train(cfg)
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    evals = [m for m in logged if "eval/success" in m]
    first, last = evals[0], evals[-1]
    # Training time only: start-up and evaluations are the same whatever the settings.
    seconds = sum(m.get(f"time/{p}_s", 0.0) for m in logged if m["step"] > 0 for p in STEP_PHASES)
    return {
        "estimator": estimator, "steps": steps, "settings": list(settings or []),
        "train_seconds": seconds, "steps_per_hour": 3600 * steps / seconds,
        "start_success": first["eval/success"], "end_success": last["eval/success"],
        "start_avg": first["eval/avg"], "end_avg": last["eval/avg"],
        "eval_curve": {m["step"]: m["eval/success"] for m in evals},
        "eval_tasks": cfg.eval.limit, "eval_n": cfg.eval.n, "levels": cfg.env.categories,
        "output_dir": output_dir,
    }
