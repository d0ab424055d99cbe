"""The points of a scaling sweep, and one short training run per point.

`--sweep key=v1,v2,...` names a config key (dotted, as an override) or `nodes`, the point's node
count; several `--sweep` options move together (point i takes the i-th value of each), so a
weak-scaling sweep is `--sweep nodes=1,2 --sweep parallel.world_size=8,16`. Every point runs
`agentgym-mega train` for `steps` steps into `OUT/point-<i>/` with evaluation off:

* `local`, no RAY_ADDRESS: each point on a fresh Ray cluster of `nodes` raylets on this machine
  (ray.cluster_utils.Cluster), each offering an equal share of the logical CPUs the run's bundles
  need (or `cpus_per_node`): the simulated multi-node cluster the CPU tests use.
* `local` with RAY_ADDRESS (inside `slurm/train_scalinginter.sh AGM_SUBCOMMAND=...`, or any running
  cluster): the points run one after another on that cluster; `nodes` cannot be swept there.
* `slurm`: one `sbatch --wait --nodes=<nodes> slurm/train_scalinginter.sh` job per point, all
  submitted at once; the driver waits for every job, then reports.

A point that fails is reported as failed (exit code, log) and the others still run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import time

from ray.cluster_utils import Cluster

from agentgym_mega.cluster import Placement
from agentgym_mega.config import Config, ConfigError, load_config
from agentgym_mega.errors import BadInput

NODES = "nodes"  # the sweep key that is not a config key
LAUNCHERS = ("local", "slurm")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLURM_SCRIPT = os.path.join(REPO, "slurm", "train_scalinginter.sh")
# Measured runs: no held-out evaluation inside them, no console bar in their logs.
RUN_OVERRIDES = ("eval.freq=0", "eval.at_start=false", "logging.progress_bar=false")


def split_values(text: str) -> list[str]:
    """`1,2,[3,4]` -> ['1', '2', '[3,4]']: commas inside brackets or braces belong to a value."""
    values, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            values.append(text[start:i].strip())
            start = i + 1
    values.append(text[start:].strip())
    return values


@dataclasses.dataclass(frozen=True)
class Point:
    index: int  # 1-based, in sweep order
    settings: tuple[tuple[str, str], ...]  # (key, value) of every --sweep, `nodes` included

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.settings)

    @property
    def nodes(self) -> int | None:
        given = dict(self.settings).get(NODES)
        return None if given is None else int(given)

    @property
    def overrides(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.settings if k != NODES]

    def run_dir(self, out_dir: str) -> str:
        return os.path.join(out_dir, f"point-{self.index}")


def points(sweeps: list[str]) -> list[Point]:
    """The points of `--sweep` options (each `key=v1,v2,...`, all of one length)."""
    if not sweeps:
        raise BadInput("--sweep: give at least one, e.g. --sweep parallel.world_size=1,2")
    columns: dict[str, list[str]] = {}
    for sweep in sweeps:
        key, sep, raw = sweep.partition("=")
        values = split_values(raw)
        if not sep or not key or not all(values):
            raise BadInput(f"--sweep {sweep!r}: expected key=v1,v2,... (a config key such as parallel.world_size, "
                           f"or {NODES})")
        if key in columns:
            raise BadInput(f"--sweep {key} is given twice; give each key once")
        if key == NODES and not all(v.isdigit() and int(v) >= 1 for v in values):
            raise BadInput(f"--sweep {sweep!r}: {NODES} takes integers >= 1")
        columns[key] = values
    lengths = {key: len(values) for key, values in columns.items()}
    if len(set(lengths.values())) > 1:
        raise BadInput(f"--sweep options move together, so each needs as many values: {lengths}")
    count = next(iter(lengths.values()))
    return [Point(i + 1, tuple((key, values[i]) for key, values in columns.items())) for i in range(count)]


def point_overrides(point: Point, overrides: list[str], steps: int, out_dir: str) -> list[str]:
    """A point's overrides of the config: the common ones, the point's, and the measured run's."""
    return [*overrides, *point.overrides, f"trainer.total_steps={steps}",
            f"trainer.output_dir={point.run_dir(out_dir)}", *RUN_OVERRIDES]


def check(config: str, overrides: list[str], sweep: list[Point], steps: int, out_dir: str, launcher: str,
          joining: bool) -> dict[int, object]:
    """Every point's config, validated before anything runs: a bad key or value of any point is
    named with the point, as is a model directory a local run cannot find."""
    if launcher == "local" and joining and any(p.nodes is not None for p in sweep):
        raise BadInput(f"--sweep {NODES}=...: a run on the current Ray cluster (RAY_ADDRESS is set) cannot change "
                       "its node count; unset RAY_ADDRESS for simulated clusters, or use --launcher slurm")
    configs = {}
    for point in sweep:
        try:
            cfg = load_config(config, point_overrides(point, overrides, steps, out_dir))
        except ConfigError as exc:
            raise BadInput(f"point {point.index} ({point.label}): {exc}") from None
        if launcher == "local" and not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
            raise BadInput(f"point {point.index} ({point.label}): model.path={cfg.model.path!r} is not a Hugging "
                           "Face model directory (no config.json)")
        configs[point.index] = cfg
        taken = os.path.join(point.run_dir(out_dir), "metrics.jsonl")
        if os.path.exists(taken):
            raise BadInput(f"{taken} exists: {out_dir} holds an earlier sweep; give another --out, or "
                           "--report-only to report it again")
    return configs


def train_command(config: str, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "agentgym_mega.cli", "train", "--config", config, *overrides]


def cpus_per_node(cfg: Config, nodes: int) -> int:
    """An equal share of the logical CPUs the run's bundles need, so that they fill the nodes."""
    return math.ceil(Placement.cpus_needed(cfg) / nodes)


def run_local(point: Point, cfg: Config, command: list[str], log_path: str, joining: bool,
              per_node: int | None = None) -> int:
    """One point's run here, its output to `log_path`; returns its exit code. Without a cluster to
    join, the point gets a fresh one of `point.nodes` (1) raylets, removed afterwards."""
    with open(log_path, "w") as log:
        if joining:
            return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode
        nodes = point.nodes or 1
        cpus = per_node or cpus_per_node(cfg, nodes)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "num_gpus": 0})
        try:
            for _ in range(nodes - 1):
                cluster.add_node(num_cpus=cpus, num_gpus=0)
            cluster.wait_for_nodes()
            log.write(f"simulated Ray cluster: {nodes} node(s) of {cpus} logical CPUs at {cluster.address}\n")
            log.flush()
            env = dict(os.environ, RAY_ADDRESS=cluster.address)
            return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env).returncode
        finally:
            cluster.shutdown()


def sbatch_command(point: Point, config: str, overrides: list[str], run_dir: str,
                   sbatch_args: list[str]) -> list[str]:
    """The point's job: the launch script with the config and overrides, `--nodes` when swept."""
    nodes = [f"--nodes={point.nodes}"] if point.nodes else []
    return ["sbatch", "--wait", *nodes, f"--job-name=agm-scaling-{point.index}",
            f"--output={os.path.join(run_dir, 'slurm-%j.out')}", *sbatch_args, SLURM_SCRIPT,
            os.path.abspath(config), *overrides]


def run_slurm(jobs: dict[int, list[str]], logs: dict[int, str]) -> dict[int, int]:
    """Submits every point's job at once and waits for all; returns each point's exit code (sbatch
    --wait exits with the job's). A stopped job is not requeued (REQUEUE=0): its steps so far
    still count."""
    env = dict(os.environ, REQUEUE="0")
    running = {}
    for index, command in jobs.items():
        with open(logs[index], "w") as log:
            running[index] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    return {index: job.wait() for index, job in running.items()}


def run(config: str, overrides: list[str], sweep: list[Point], steps: int, out_dir: str, launcher: str,
        per_node: int | None, sbatch_args: list[str], progress) -> dict[int, dict]:
    """Runs every point; returns per point index {exit, seconds, log}. `progress(text)` is told
    of each start and end."""
    joining = bool(os.environ.get("RAY_ADDRESS"))
    configs = check(config, overrides, sweep, steps, out_dir, launcher, joining)
    outcomes: dict[int, dict] = {}
    for point in sweep:
        os.makedirs(point.run_dir(out_dir), exist_ok=True)
    logs = {p.index: os.path.join(p.run_dir(out_dir), "launch.log" if launcher == "slurm" else "train.log")
            for p in sweep}
    if launcher == "slurm":
        started = time.monotonic()
        progress(f"submitting {len(sweep)} job(s), one per point; waiting for all")
        codes = run_slurm({p.index: sbatch_command(p, config, point_overrides(p, overrides, steps, out_dir),
                                                   p.run_dir(out_dir), sbatch_args) for p in sweep}, logs)
        return {i: {"exit": code, "seconds": time.monotonic() - started, "log": logs[i]} for i, code in codes.items()}
    for point in sweep:
        progress(f"point {point.index}/{len(sweep)} ({point.label}): running, log {logs[point.index]}")
        started = time.monotonic()
        command = train_command(config, point_overrides(point, overrides, steps, out_dir))
        code = run_local(point, configs[point.index], command, logs[point.index], joining, per_node)
        outcomes[point.index] = {"exit": code, "seconds": time.monotonic() - started, "log": logs[point.index]}
        progress(f"point {point.index}/{len(sweep)}: exit {code} after {outcomes[point.index]['seconds']:.0f} s")
    return outcomes
