"""`agentgym-mega scaling`: a sweep of short runs, or the projection for 7B-70B at 1-16 nodes."""

from __future__ import annotations

import dataclasses
import os
import sys

from agentgym_mega.cli.options import COUNT, bounded, command, counts, json_option, overrides_option, write_json
from agentgym_mega.errors import BadInput
from agentgym_mega.scaling import assumptions, report

# Imported when the command runs: the sweep, the projection and the placement pull in torch and
# Ray, the config schema pydantic, and tqdm its own imports; --help should pay for none of them.


def add(sub) -> None:
    p = command(
        sub, "scaling", func=run,
        help="scaling experiments: a short run per point of a sweep, or the estimate for 7B-70B at 1-16 nodes",
        description=(
            "A sweep (--config X --sweep key=v1,v2,...): a short `train` run of --steps steps per point\n"
            "(evaluation off) into OUT/point-<i>/, then per point over the steps after --warmup: seconds\n"
            "per step of each phase (rollout, log-probs, train, sync), tokens/s, speedup and efficiency\n"
            "(speedup over the devices ratio) against the first point; written as OUT/scaling.json,\n"
            "OUT/scaling.md and OUT/scaling.png. A sweep key is a config key or `nodes` (the point's\n"
            "node count); several --sweep options move together (point i takes each one's i-th value).\n"
            "--launcher local: each point on a fresh Ray cluster of `nodes` raylets on this machine (a\n"
            "simulated multi-node cluster), or on the running one when RAY_ADDRESS is set; --launcher\n"
            "slurm: one `sbatch --wait slurm/train_scalinginter.sh` job per point, all submitted at once.\n"
            "A failed point is reported as failed; the exit code is then 1.\n"
            "\n"
            "--project: no runs, an ESTIMATE from the planner's memory and FLOP counts and the stated\n"
            "rates below, for each --config recipe (default: the TextCraft recipes of 7B, 14B, 32B and\n"
            "70B) scaled by data parallelism to each of --nodes; the model is in\n"
            "agentgym_mega/scaling/projection.py."
        ),
    )
    p.add_argument("--config", action="append", help="YAML config; --project takes several (default: recipes)")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="a config key (or nodes) and its values, one per point; repeat to move keys together")
    p.add_argument("--steps", type=COUNT, default=3, help="training steps per point (default 3)")
    p.add_argument("--warmup", type=bounded(int, 0, "an integer >= 0"), default=1,
                   help="first steps of a point left out of its figures (default 1: vLLM's warm-up)")
    p.add_argument("--out", help="the sweep's directory (default runs/scaling/<config name>)")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local", help="where points run (default local)")
    p.add_argument("--cpus-per-node", type=COUNT,
                   help="local: logical CPUs of each simulated node (default: the run's bundles over the nodes)")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="slurm: an extra sbatch option for every point's job, e.g. --sbatch-arg=--partition=gpu")
    p.add_argument("--report-only", action="store_true", help="run nothing: report the points already in --out")
    p.add_argument("--project", action="store_true", help="print the estimate instead of running a sweep")
    p.add_argument("--nodes", type=counts, default=list(assumptions.NODES),
                   help="--project: comma list of node counts (default 1,2,4,8,16)")
    p.add_argument("--gpus-per-node", type=COUNT, default=8, help="--project: GPUs per node (default 8)")
    p.add_argument("--gpu-mem-gb", type=bounded(float, 0, "a number of GB > 0"), default=80.0,
                   help="--project: memory of one GPU in decimal GB (default 80)")
    for cls in (assumptions.Hardware, assumptions.Workload):
        for field in dataclasses.fields(cls):
            counted = field.type.startswith("int")  # "int", "int | None" (postponed annotations)
            p.add_argument(f"--{field.name.replace('_', '-')}", dest=field.name, default=field.default,
                           type=COUNT if counted else bounded(float, 0, "a number > 0"),
                           help=f"--project: {field.metadata['help']} (default {field.default})")
    json_option(p, "--project: also write the estimate as JSON here")
    overrides_option(p)


def run(args) -> int:
    from tqdm import tqdm

    from agentgym_mega.cluster import Placement
    from agentgym_mega.config import load_config
    from agentgym_mega.scaling import projection, sweep

    if args.project:
        from agentgym_mega import memory_plan

        recipes = []
        for path in args.config or [os.path.join(sweep.REPO, r) for r in projection.RECIPES]:
            cfg = load_config(path, args.overrides)
            recipes.append((path, cfg, memory_plan.read_architecture(cfg.model)[0]))
        pick = lambda cls: cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})  # noqa: E731
        result = projection.project(recipes, args.nodes, pick(projection.Hardware), pick(projection.Workload),
                                    args.gpus_per_node, args.gpu_mem_gb)
        print(projection.table(result))
        write_json(args.json, result)
        return 0
    if not args.config or len(args.config) > 1:
        raise BadInput("--config: a sweep takes exactly one config (several only with --project)")
    if args.warmup >= args.steps:
        raise BadInput(f"--steps {args.steps} with --warmup {args.warmup}: no step would be measured; "
                       "give more steps than warm-up steps")
    config = args.config[0]
    points = sweep.points(args.sweep)
    name = os.path.splitext(os.path.basename(config))[0]
    out_dir = os.path.abspath(args.out or os.path.join("runs", "scaling", name))
    outcomes = {}
    if not args.report_only:
        outcomes = sweep.run(config, args.overrides, points, args.steps, out_dir, args.launcher, args.cpus_per_node,
                             args.sbatch_arg, tqdm.write)
    rows = []
    for point in points:
        cfg = load_config(config, sweep.point_overrides(point, args.overrides, args.steps, out_dir))
        row = {"index": point.index, "label": point.label, "nodes": point.nodes,
               "devices": Placement.device_bundles(cfg)} | outcomes.get(point.index, {})
        rows.append(row | report.summarize(point.run_dir(out_dir), args.warmup))
    result = report.build(rows)
    title = f"scaling: {name}, {args.steps} steps per point ({args.warmup} warm-up)"
    paths = report.write(result, out_dir, title)
    print(report.table(result))
    print("wrote " + ", ".join(paths.values()))
    failed = [r["label"] for r in rows if r.get("exit") or "tokens_per_s" not in r]
    if failed:
        print(f"agentgym-mega scaling: no figures for {len(failed)} point(s): {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0

