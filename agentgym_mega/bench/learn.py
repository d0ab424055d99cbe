"""`agentgym-mega bench learn`: does an estimator learn? A config's task (by default the CPU
demo's, configs/demo_cpu.yaml: three BabyAI levels, the tiny base policy, a ScalingInter horizon)
trained with the chosen estimator (by default the config's own), reporting held-out success at the
start and at the end.

The config's schedule is kept in proportion when `--steps` shortens its run: the turn cap steps
through its stages at the same fractions of the run, and evaluations come as often relative to its
length. The base policy is pretrained first when it is missing (as `make demo` does).
"""

from __future__ import annotations

import json
import os
import statistics

from agentgym_mega import cli
from agentgym_mega.config import Config, load_config
from agentgym_mega.trainer import train

DEMO_CONFIG = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "demo_cpu.yaml"))


def overrides(estimator: str, steps: int, output_dir: str, config: str = DEMO_CONFIG) -> list[str]:
    """`config`'s settings for `estimator` over `steps` steps, its schedule scaled from its own
    trainer.total_steps (which its horizon interval and eval frequency are set for)."""
    base = load_config(config)
    scale = steps / base.trainer.total_steps
    # a config that never evaluates still gets the start and the end, which bench learn compares
    eval_freq = max(1, round(base.eval.freq * scale)) if base.eval.freq else steps
    return [f"algorithm.estimator={estimator}", f"trainer.total_steps={steps}",
            f"horizon.interval={max(1, round(base.horizon.interval * scale))}",
            f"eval.freq={eval_freq}", "eval.at_start=true",
            f"trainer.save_freq={steps}", f"trainer.output_dir={output_dir}"]


def ensure_base(cfg: Config) -> None:
    if os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        return
    categories = ["--categories", ",".join(cfg.env.categories)] if cfg.env.categories else []
    code = cli.main(["pretrain-tiny", "--env", cfg.env.name, *categories, "--out", cfg.model.path])
    if code:
        raise RuntimeError(f"pretraining the base policy into {cfg.model.path} failed (exit {code})")


# A step's phases as the trainer times them (time/generate_s and time/env_s are parts of rollout).
STEP_PHASES = ("rollout", "logprob", "values", "train", "rollout_wait", "sync")


def run(estimator: str, steps: int, output_dir: str, settings: list[str] | None = None,
        config: str = DEMO_CONFIG) -> dict:
    """`settings`: more config overrides (e.g. rollout.mode=async), applied last."""
    cfg = load_config(config, overrides(estimator, steps, output_dir, config) + list(settings or []))
    ensure_base(cfg)
    if os.path.exists(os.path.join(output_dir, "metrics.jsonl")):
        raise RuntimeError(f"{output_dir} already holds a run: remove it or pass --output-dir")
    train(cfg)
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        logged = [json.loads(line) for line in f]
    trained = [m for m in logged if m["step"] > 0]
    # Training time only: start-up and evaluations are the same whatever the settings.
    phases = {p: sum(m.get(f"time/{p}_s", 0.0) for m in trained) / steps for p in STEP_PHASES}
    seconds = steps * sum(phases.values())
    report = {
        "config": config, "estimator": estimator, "steps": steps, "settings": list(settings or []),
        "train_seconds": seconds, "steps_per_hour": 3600 * steps / seconds,
        "seconds_per_step_by_phase": phases,
        "levels": cfg.env.categories, "output_dir": output_dir,
    }
    evals = [m for m in logged if "eval/success" in m]
    if evals:  # none when the settings turn evaluation off (a throughput comparison)
        first, last = evals[0], evals[-1]
        report |= {"start_success": first["eval/success"], "end_success": last["eval/success"],
                   "start_avg": first["eval/avg"], "end_avg": last["eval/avg"],
                   "eval_curve": {m["step"]: m["eval/success"] for m in evals},
                   "eval_tasks": cfg.eval.limit, "eval_n": cfg.eval.n}
    return report


# One-step off-policy against lockstep, its two effects apart: off-policy (without tis_cap) skips
# the trainer's old-log-prob pass *and* overlaps the next rollout with the update. The middle arm
# skips only the pass, so lockstep -> pass skipped -> off-policy shows what each adds.
OFF_POLICY_ARMS = {
    "lockstep": [],
    "lockstep_pass_skipped": ["algorithm.old_logprobs=engine"],
    "off_policy": ["cluster.placement=split", "trainer.off_policy_steps=1"],
}
NO_EVAL = ["eval.at_start=false", "eval.freq=0"]  # steps_per_hour leaves evaluations out anyway


def compare_off_policy(estimator: str, steps: int, rounds: int, output_dir: str,
                       settings: list[str] | None = None, config: str = DEMO_CONFIG) -> dict:
    """Each arm of OFF_POLICY_ARMS trained `rounds` times from the same base, interleaved (arm
    order reversed every other round, so drift of a shared machine's load meets every arm alike);
    an arm's figure is the median of its rounds."""
    runs: dict[str, list[dict]] = {arm: [] for arm in OFF_POLICY_ARMS}
    for r in range(rounds):
        order = list(OFF_POLICY_ARMS) if r % 2 == 0 else list(reversed(OFF_POLICY_ARMS))
        for arm in order:
            arm_settings = NO_EVAL + list(settings or []) + OFF_POLICY_ARMS[arm]
            runs[arm].append(run(estimator, steps, os.path.join(output_dir, f"{arm}-{r}"), arm_settings, config))

    def median(arm: str, key) -> float:
        return statistics.median(key(x) for x in runs[arm])

    rate = {arm: median(arm, lambda x: x["steps_per_hour"]) for arm in runs}
    return {
        "what": "steps/hour over the steps' own time (rollout, log-probs, update, rollout wait, sync), "
                "median of the rounds; evaluations off",
        "config": config, "estimator": estimator, "steps": steps, "rounds": rounds, "settings": list(settings or []),
        "arms": {arm: OFF_POLICY_ARMS[arm] for arm in runs},
        "steps_per_hour": rate,
        "speedup_vs_lockstep": {arm: rate[arm] / rate["lockstep"] for arm in runs},
        # off-policy's gain beyond skipping the pass: the overlap of the next rollout with the update
        "overlap_speedup": rate["off_policy"] / rate["lockstep_pass_skipped"],
        "seconds_per_step_by_phase": {arm: {p: median(arm, lambda x, p=p: x["seconds_per_step_by_phase"][p])
                                            for p in STEP_PHASES} for arm in runs},
        "steps_per_hour_per_round": {arm: [x["steps_per_hour"] for x in runs[arm]] for arm in runs},
        # within a round the arms ran back to back: these ratios see less of the load's drift
        "speedup_vs_lockstep_per_round": {arm: [x["steps_per_hour"] / base["steps_per_hour"]
                                                for x, base in zip(runs[arm], runs["lockstep"])] for arm in runs},
        "output_dir": output_dir,
    }
