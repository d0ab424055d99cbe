"""The paper's horizon experiment (`agentgym-mega study horizon`): arms of one base config that
differ only in their turn-cap schedule, each trained with several seeds, one `train` run after
another in OUT/<arm>/seed_<k>/.

* Arms: `scaling_inter` (the caps in stages of `interval` steps), `short` (fixed at the first
  cap), `long` (fixed at the last); a `_gigpo` suffix trains the same schedule with
  algorithm.estimator=gigpo and gamma 0.95 (gigpo's step credit needs a discount below 1).
* Seeds: seed k (1..n) trains with trainer.seed = the config's seed + k, every one from the same
  base policy (model.path).
* Resuming: OUT/study.json records the study's settings, and a rerun with other settings is
  refused rather than mixing runs; a run whose metrics.jsonl holds the last step's evaluation is
  not run again, an unfinished one goes on from its checkpoint (`train --resume auto`).

The figures are study_report's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess

import envs
from agentgym_mega import study_report
from agentgym_mega.config import Config, ConfigError, load_config, to_dict
from agentgym_mega.errors import BadInput
from agentgym_mega.files import write_text_atomic
from agentgym_mega.metrics import read_metrics
from agentgym_mega.rollout.tasks import select_tasks
from agentgym_mega.scaling.sweep import train_command

ARM_KINDS = ("scaling_inter", "short", "long")
GIGPO = "_gigpo"
GIGPO_OVERRIDES = ("algorithm.estimator=gigpo", "algorithm.gamma=0.95")
SETTINGS = "study.json"
# Every run's own: the study prints a progress line per step instead of the run's console bar.
RUN_OVERRIDES = ("logging.progress_bar=false",)
# --quick: small batches, two steps per stage (every stage runs), evaluations every 3 steps on a few tasks.
QUICK_INTERVAL = 2
QUICK_OVERRIDES = ("trainer.batch_size=4", "trainer.mini_batch_size=2", "rollout.n_per_task=4",
                   "trainer.save_freq=3", "eval.freq=3", "eval.limit=8", "eval.n=1")
STEP_LINE = re.compile(r"step (\d+): ")  # the trainer's line after each step
FORWARDED = (signal.SIGTERM, signal.SIGUSR1)  # train stops on either after a step, checkpointed


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    schedule: str  # the config's horizon.schedule: fixed or scaling_inter
    caps: tuple[int, ...]
    interval: int | None  # steps per stage; None for a fixed cap
    gigpo: bool = False

    @property
    def overrides(self) -> list[str]:
        stages = [f"horizon.interval={self.interval}"] if self.interval else []
        return [f"horizon.schedule={self.schedule}", f"horizon.caps=[{','.join(map(str, self.caps))}]", *stages,
                *(GIGPO_OVERRIDES if self.gigpo else ())]

    def boundaries(self, steps: int) -> list[int]:
        """The last step of every stage but the last (the cap grows after it), within `steps`."""
        if self.interval is None:
            return []
        return [self.interval * i for i in range(1, len(self.caps)) if self.interval * i < steps]


@dataclasses.dataclass(frozen=True)
class Run:
    arm: Arm
    k: int  # the seed's number, 1..seeds: trainer.seed = the config's seed + k
    seed: int
    path: str  # trainer.output_dir
    overrides: tuple[str, ...]  # every override of the run's config


@dataclasses.dataclass(frozen=True)
class Study:
    config: str  # the base config's absolute path
    out_dir: str
    cfg: Config  # the base config with the study's shared overrides (the arms' are not in it)
    arms: list[Arm]
    seeds: int
    runs: list[Run]
    settings: dict  # what OUT/study.json records


def arms(names: list[str], caps: list[int], interval: int) -> list[Arm]:
    """The arms named (`scaling_inter`, `short`, `long`, each optionally with `_gigpo`)."""
    if len(caps) < 2 or any(a >= b for a, b in zip(caps, caps[1:])):
        raise BadInput(f"horizon caps {caps}: the study needs two or more strictly increasing caps (short = the "
                       "first, long = the last); give --caps, e.g. --caps 4,8,12")
    if len(set(names)) < len(names):
        raise BadInput(f"--arms {','.join(names)}: an arm is named twice")
    out = []
    for name in names:
        kind = name.removesuffix(GIGPO)
        if kind not in ARM_KINDS:
            raise BadInput(f"--arms: unknown arm {name!r}; the arms are {', '.join(ARM_KINDS)}, each also with "
                           f"the suffix {GIGPO} (e.g. scaling_inter{GIGPO})")
        gigpo = name.endswith(GIGPO)
        if kind == "scaling_inter":
            out.append(Arm(name, "scaling_inter", tuple(caps), interval, gigpo))
        else:
            out.append(Arm(name, "fixed", (caps[0] if kind == "short" else caps[-1],), None, gigpo))
    return out


def plan(arm_list: list[Arm], seeds: int, base_seed: int, shared: list[str], out_dir: str) -> list[Run]:
    """Every (arm, seed) run, arm by arm: the shared overrides, the arm's, then the run's own."""
    runs = []
    for arm in arm_list:
        for k in range(1, seeds + 1):
            path = os.path.join(out_dir, arm.name, f"seed_{k}")
            overrides = (*shared, *arm.overrides, f"trainer.seed={base_seed + k}", f"trainer.output_dir={path}",
                         *RUN_OVERRIDES)
            runs.append(Run(arm, k, base_seed + k, path, overrides))
    return runs


def _load(config: str, overrides, what: str) -> Config:
    try:
        return load_config(config, list(overrides))
    except ConfigError as exc:
        raise BadInput(f"{what}: {exc}") from None


def prepare(config: str, overrides: list[str], names: list[str], seeds: int, caps: list[int] | None,
            interval: int | None, quick: bool, out_dir: str) -> Study:
    """The study's runs from its arguments, every run's config checked before anything runs."""
    config = os.path.abspath(config)
    given = _load(config, overrides, "the base config").horizon
    caps = caps or given.caps
    interval = interval or (QUICK_INTERVAL if quick else given.interval)
    small = [*QUICK_OVERRIDES, f"trainer.total_steps={interval * len(caps)}"] if quick else []
    shared = small + list(overrides)  # the user's last: they win over --quick's
    cfg = _load(config, shared, "the base config")
    if not cfg.eval.freq:
        raise BadInput("eval.freq=0: the study compares held-out success at the runs' evaluations; give eval.freq")
    arm_list = arms(names, caps, interval)
    runs = plan(arm_list, seeds, cfg.trainer.seed, shared, out_dir)
    for run in runs:
        _load(config, run.overrides, f"arm {run.arm.name} seed {run.k}")
    settings = {"config": config, "overrides": list(overrides), "quick": quick, "arms": names, "seeds": seeds,
                "caps": caps, "interval": interval, "base": to_dict(cfg)}
    settings = json.loads(json.dumps(settings))  # as study.json will read back (tuples as lists)
    return Study(config, out_dir, cfg, arm_list, seeds, runs, settings)


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def differences(recorded: dict, now: dict) -> list[str]:
    """`key: recorded X, now Y` for every setting (base config keys dotted) that differs."""
    old, new = _flat(recorded), _flat(now)
    missing = object()
    return [f"{key}: recorded {old.get(key, '(none)')!r}, now {new.get(key, '(none)')!r}"
            for key in sorted(old.keys() | new.keys()) if old.get(key, missing) != new.get(key, missing)]


def check_settings(study: Study, record: bool) -> None:
    """Refuses a study whose settings differ from those OUT/study.json records; records them
    when there are none yet and `record` (a study about to run)."""
    path = os.path.join(study.out_dir, SETTINGS)
    if not os.path.isfile(path):
        if not record:
            raise BadInput(f"{path} does not exist: no study ran in {study.out_dir}")
        os.makedirs(study.out_dir, exist_ok=True)
        write_text_atomic(path, json.dumps(study.settings, indent=2))
        return
    with open(path) as f:
        found = differences(json.load(f), study.settings)
    if found:
        raise BadInput(f"{path} records another study; its runs would mix with this one's. Differences: "
                       f"{'; '.join(found)}. Give the recorded settings to go on with it, or another --out")


def finished(run_dir: str, steps: int) -> bool:
    """Whether the run logged its last step with that step's evaluation."""
    if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        return False
    return study_report.SUCCESS in read_metrics(run_dir).get(steps, {})


def train(command: list[str], log_path: str, on_step) -> int:
    """Runs one `train` command, its output appended to `log_path`; `on_step(step)` after each
    step it reports. SIGTERM and SIGUSR1 reach it, so it stops after a step, checkpointed,
    rather than running on without the study. Returns its exit code."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # each step's line as it comes, not at exit
    with open(log_path, "a") as log, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                       text=True, env=env) as child:
        previous = {s: signal.signal(s, lambda signum, _: child.send_signal(signum)) for s in FORWARDED}
        try:
            for line in child.stdout:
                log.write(line)
                match = STEP_LINE.match(line)
                if match:
                    on_step(int(match.group(1)))
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
    return child.returncode


def run_all(study: Study, progress=print) -> int:
    """Every run not finished yet, one after another; stops at the first that fails (its exit
    code is returned: the same command then goes on from that run's checkpoint)."""
    steps = study.cfg.trainer.total_steps
    for i, run in enumerate(study.runs, 1):
        where = f"[study] arm {run.arm.name} seed {run.k}/{study.seeds}"
        if finished(run.path, steps):
            progress(f"{where}: finished before, not run again")
            continue
        os.makedirs(run.path, exist_ok=True)
        log = os.path.join(run.path, "study.log")
        started = os.path.exists(os.path.join(run.path, "metrics.jsonl"))
        state = "going on from its checkpoint" if started else "starting"
        progress(f"{where}: {state} (run {i} of {len(study.runs)}), log {log}")
        command = train_command(study.config, [*run.overrides, "--resume", "auto"])
        code = train(command, log, lambda step: progress(f"{where} step {step}/{steps}"))
        if code:
            progress(f"{where}: train exited {code}, see {log}; the same command goes on from its last checkpoint")
            return code
    return 0


def eval_tasks(cfg: Config) -> int | None:
    """The held-out tasks each evaluation plays, as the trainer selects them; None when this
    machine cannot read the environment's catalogue (its data not installed)."""
    try:
        catalogue = envs.load_kind(cfg.env.name, cfg.env.options).tasks()
    except (ImportError, OSError, ValueError):
        return None
    return len(select_tasks(catalogue, cfg.eval.split, None, cfg.env.categories)[: cfg.eval.limit])


def summaries(study: Study) -> list[dict]:
    """Each arm's figures from its runs' metrics.jsonl (a run not started counts as no records)."""
    steps = study.cfg.trainer.total_steps
    read = lambda path: read_metrics(path) if os.path.isfile(os.path.join(path, "metrics.jsonl")) else {}  # noqa: E731
    return [study_report.summarize(arm, [r.seed for r in study.runs if r.arm == arm],
                                   [read(r.path) for r in study.runs if r.arm == arm], steps)
            for arm in study.arms]


def report(study: Study, arm_figures: list[dict]) -> dict:
    """The --json report: the arms' figures, the levels, the steps and the evaluation's size."""
    cfg = study.cfg
    evaluation = {"tasks": eval_tasks(cfg), "n": cfg.eval.n,
                  "max_turns": cfg.eval.max_turns or envs.eval_max_turns(cfg.env.name)}
    return study_report.to_json(arm_figures, cfg.env.categories, cfg.trainer.total_steps, evaluation)
