"""`agentgym-mega`: one subcommand per capability. Each parses its arguments and calls one function."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import re
import signal
import sys
import threading

from agentgym_mega.errors import EXIT_BAD_INPUT, BadInput
from envs import KINDS, limits

_FORMAT = argparse.RawDescriptionHelpFormatter
_BENCH_JSON = "write the report here"
_REPORT_JSON = "also write the report as JSON here"
_SYNC_TRANSPORTS = ("zmq", "collective")
_DEVICES = ("cpu", "cuda")  # retriever --device  # bench sync --transport (agentgym_mega.bench.sync.TRANSPORTS)


# Argument types: a bad value exits 2 with argparse's message naming the option.

def _bounded(kind, low, what: str):
    """An argparse type: `kind` parsed and at least `low` (> `low` for floats), else exit 2."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value < low or (kind is float and value == low):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value
    return parse


_COUNT = _bounded(int, 1, "an integer >= 1")


def _port(text: str) -> int:
    port = _bounded(int, 1, "a port in 1-65535")(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port in 1-65535")
    return port


def _concurrency(text: str) -> list[int]:
    parse = _bounded(int, 1, "a comma list of integers >= 1, e.g. 1,16,64,256")
    return [parse(item.strip()) for item in text.split(",")]


def _names(allowed: tuple[str, ...], what: str):
    """An argparse type: a comma list of names from `allowed`, else exit 2 naming the unknown."""
    def parse(text: str) -> list[str]:
        names = [t.strip() for t in text.split(",")]
        unknown = [t for t in names if t not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown}; allowed: {', '.join(allowed)}")
        return names
    return parse


def _checks(text: str) -> list[str]:
    checks = [c.strip() for c in text.split(",")]
    unknown = [c for c in checks if c not in ("megatron", "vllm")]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown check(s) {unknown}; allowed: megatron, vllm")
    return checks


def _layouts(text: str) -> list[tuple[int, int, int]]:
    """`tp2,pp2,dp2` -> [(tp, pp, world), ...]: each layout runs on N local ranks."""
    out = []
    for item in text.split(","):
        match = re.fullmatch(r"(tp|pp|dp)([1-9][0-9]*)", item.strip())
        if not match:
            raise argparse.ArgumentTypeError(f"{item!r}: expected tpN, ppN or dpN, e.g. tp2,pp2,dp2")
        kind, n = match.group(1), int(match.group(2))
        out.append({"tp": (n, 1, n), "pp": (1, n, n), "dp": (1, 1, n)}[kind])
    return out


# Shared parts of the subcommands.

def _command(sub, name: str, help: str, description: str, **defaults) -> argparse.ArgumentParser:
    """Adds subcommand `name`; `defaults` name what runs it (func=, or run= for a benchmark)."""
    p = sub.add_parser(name, formatter_class=_FORMAT, help=help, description=description)
    p.set_defaults(**defaults)
    return p


def _json_option(p, help: str) -> None:
    p.add_argument("--json", help=help)


def _overrides_option(p) -> None:
    p.add_argument("overrides", nargs="*", metavar="section.key=value")


def _add_shape_args(p, kv_heads: int, vocab: int) -> None:
    p.add_argument("--layers", type=_COUNT, default=2)
    p.add_argument("--hidden", type=_COUNT, default=128)
    p.add_argument("--heads", type=_COUNT, default=2)
    p.add_argument("--kv-heads", type=_COUNT, default=kv_heads, help="key/value heads (GQA); divides --heads")
    p.add_argument("--vocab", type=_COUNT, default=vocab, help="BPE vocabulary and model vocab size")
    p.add_argument("--ffn", type=_COUNT, default=None, help="MLP width (default 3 x hidden)")
    p.add_argument("--seed", type=int, default=0)


def _validate_spec(spec) -> None:
    try:
        spec.validate()
    except ValueError as exc:
        raise BadInput(str(exc)) from None


def _write_json(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


def _require_hf_dir(what: str, path: str) -> None:
    """Checked before anything starts: a bad model path should not cost a Ray and engine start-up."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise BadInput(f"{what}={path!r} is not a Hugging Face model directory (no config.json)")


# The subcommands: each `_add_*` registers one, its `_cmd_*` runs it.

def _add_config(sub) -> None:
    p = _command(
        sub, "config", func=_cmd_config,
        help="validate a config and print it with includes and overrides applied",
        description=(
            "Loads a YAML config (following its `include:` files), applies dotted overrides such as\n"
            "trainer.total_steps=50 or horizon.caps=[6,13,20], validates every key, and prints the\n"
            "resolved config. Exit code 2 and a message naming the key on any invalid value."
        ),
    )
    p.add_argument("--config", help="YAML file; omitted: the built-in defaults")
    p.add_argument("--out", help="write the resolved YAML here instead of stdout")
    _overrides_option(p)


def _cmd_config(args) -> int:
    from agentgym_mega.config import dump_yaml, load_config

    cfg = load_config(args.config, args.overrides)
    text = dump_yaml(cfg)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _add_train(sub) -> None:
    p = _command(
        sub, "train", func=_cmd_train,
        help="run multi-turn agentic RL (GRPO/PPO/REINFORCE++/RLOO with a ScalingInter horizon)",
        description=(
            "Starts Ray, the environment servers (or uses env.server_urls), vLLM engines and the\n"
            "megatron-core actor (plus reference policy and critic when configured), then loops:\n"
            "rollout -> log-probs -> advantages -> updates -> weight sync -> log -> checkpoint.\n"
            "Metrics go to OUTPUT_DIR/metrics.jsonl and OUTPUT_DIR/tensorboard; checkpoints to\n"
            "OUTPUT_DIR/checkpoints (trainer.output_dir). --resume continues from the latest one.\n"
            "SIGUSR1 (Slurm: --signal=B:USR1@300) stops the run after the current step with a\n"
            "checkpoint and exit code 75; the same command with --resume goes on at the next step,\n"
            "turn cap and task-sampler position."
        ),
    )
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    p.add_argument("--resume", nargs="?", const="latest", choices=["latest", "auto"],
                   help="continue from the latest checkpoint in trainer.output_dir (an error when there is "
                        "none); `--resume auto` starts fresh when there is none")
    _overrides_option(p)


def _cmd_train(args) -> int:
    # From the first moment: SIGUSR1's default action would kill a run still starting up.
    stop = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: stop.set())
    from agentgym_mega.config import load_config
    from agentgym_mega.trainer import STOPPED_EXIT_CODE, Stopped, train

    cfg = load_config(args.config, args.overrides)
    _require_hf_dir("model.path", cfg.model.path)
    try:
        train(cfg, resume=args.resume, stop=stop)
    except Stopped as stopped:
        print(f"agentgym-mega train: {stopped}; exit {STOPPED_EXIT_CODE}", file=sys.stderr)
        return STOPPED_EXIT_CODE
    return 0


def _add_eval(sub) -> None:
    p = _command(
        sub, "eval", func=_cmd_eval,
        help="evaluate a model on an environment split: Avg@n and Pass@n per category",
        description=(
            "The AgentGym protocol: --n samples per task at rollout.temperature, the environment's\n"
            "evaluation turn limit (BabyAI 20, TextCraft and SciWorld 30) unless --max-turns, through\n"
            "real env servers and the config's vLLM engines (rollout.num_engines, placed as in\n"
            "training). Prints Avg@n (mean score) and Pass@n (share of tasks with a sample scoring\n"
            "> 0) overall and per category (TextCraft depth, BabyAI level, SciWorld task). A megatron\n"
            "checkpoint (--ckpt) is exported to HF first."
        ),
    )
    p.add_argument("--config", required=True, help="YAML config (env, rollout settings)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", help="Hugging Face model directory")
    source.add_argument("--ckpt", help="megatron checkpoint (a directory, or a root with `latest`)")
    p.add_argument("--n", type=_COUNT, help="samples per task (default eval.n)")
    p.add_argument("--split", choices=["train", "test"], help="task split (default eval.split)")
    p.add_argument("--limit", type=_COUNT, help="only the first N tasks of the split (default eval.limit)")
    p.add_argument("--max-turns", type=_COUNT, help="turn cap (default eval.max_turns, else the environment's)")
    _json_option(p, _REPORT_JSON)
    _overrides_option(p)


def _cmd_eval(args) -> int:
    from agentgym_mega import evaluation
    from agentgym_mega.config import load_config

    if args.hf:
        _require_hf_dir("--hf", args.hf)
    cfg = load_config(args.config, args.overrides)
    pick = lambda flag, key: getattr(cfg.eval, key) if flag is None else flag  # noqa: E731
    report = evaluation.run(cfg, args.hf, args.ckpt, pick(args.n, "n"), pick(args.split, "split"),
                            pick(args.limit, "limit"), pick(args.max_turns, "max_turns"))
    print(evaluation.table(report))
    _write_json(args.json, report)
    return 0


def _add_plan(sub) -> None:
    p = _command(
        sub, "plan", func=_cmd_plan,
        help="plan a config's device memory per GPU and say whether it fits (no GPU, no weights)",
        description=(
            "Reads the config (with overrides) and the model's config.json (model.path, else\n"
            "model.architecture; no weights) and prints, per GPU, the bytes of each role: the actor's,\n"
            "reference's and critic's parameters, fp32 gradient buffers, Adam state sharded over DP,\n"
            "activations of one micro-batch (with parallel.recompute) and log-prob peak; the engines'\n"
            "weights and KV cache within rollout.gpu_memory_utilization. Then the peak of each phase of\n"
            "the loop (start-up/resume, rollout, training, weight sync) for the colocated or split\n"
            "placement, against --gpu-mem-gb less 5% headroom (decimal GB: an 80 GB H100 has 85.5).\n"
            "A layout that does not fit, or that megatron or vLLM refuses, exits 2 with the reason and\n"
            "up to 3 nearest layouts that fit, as overrides to paste. The model of memory is in\n"
            "agentgym_mega/memory_plan.py and README.md (\"Planning memory\")."
        ),
    )
    p.add_argument("--config", required=True, help="YAML config (e.g. configs/recipes/*.yaml)")
    p.add_argument("--gpus-per-node", type=_COUNT, default=8, help="GPUs per node (default 8)")
    p.add_argument("--gpu-mem-gb", type=_bounded(float, 0, "a number of GB > 0"), default=80.0,
                   help="memory of one GPU in decimal GB (default 80)")
    p.add_argument("--nodes", type=_COUNT, help="nodes available (default: as many as the layout needs)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes) instead of tables")
    _overrides_option(p)


def _cmd_plan(args) -> int:
    from agentgym_mega import memory_plan
    from agentgym_mega.config import load_config

    cfg = load_config(args.config, args.overrides)
    hf, source = memory_plan.read_architecture(cfg.model)
    result = memory_plan.plan(cfg, hf, args.gpus_per_node, args.gpu_mem_gb, args.nodes, source)
    print(json.dumps(result, indent=2) if args.json else memory_plan.render(result))
    if not result["fits"]:
        raise BadInput(memory_plan.refusal(result["reason"], result["nearest"]))
    return 0


def _add_scaling(sub) -> None:
    from agentgym_mega.scaling import assumptions

    p = _command(
        sub, "scaling", func=_cmd_scaling,
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
    p.add_argument("--steps", type=_COUNT, default=3, help="training steps per point (default 3)")
    p.add_argument("--warmup", type=_bounded(int, 0, "an integer >= 0"), default=1,
                   help="first steps of a point left out of its figures (default 1: vLLM's warm-up)")
    p.add_argument("--out", help="the sweep's directory (default runs/scaling/<config name>)")
    p.add_argument("--launcher", choices=("local", "slurm"), default="local", help="where points run (default local)")
    p.add_argument("--cpus-per-node", type=_COUNT,
                   help="local: logical CPUs of each simulated node (default: the run's bundles over the nodes)")
    p.add_argument("--sbatch-arg", action="append", default=[], metavar="ARG",
                   help="slurm: an extra sbatch option for every point's job, e.g. --sbatch-arg=--partition=gpu")
    p.add_argument("--report-only", action="store_true", help="run nothing: report the points already in --out")
    p.add_argument("--project", action="store_true", help="print the estimate instead of running a sweep")
    p.add_argument("--nodes", type=_concurrency, default=list(assumptions.NODES),
                   help="--project: comma list of node counts (default 1,2,4,8,16)")
    p.add_argument("--gpus-per-node", type=_COUNT, default=8, help="--project: GPUs per node (default 8)")
    p.add_argument("--gpu-mem-gb", type=_bounded(float, 0, "a number of GB > 0"), default=80.0,
                   help="--project: memory of one GPU in decimal GB (default 80)")
    for cls in (assumptions.Hardware, assumptions.Workload):
        for field in dataclasses.fields(cls):
            counted = field.type.startswith("int")  # "int", "int | None" (postponed annotations)
            p.add_argument(f"--{field.name.replace('_', '-')}", dest=field.name, default=field.default,
                           type=_COUNT if counted else _bounded(float, 0, "a number > 0"),
                           help=f"--project: {field.metadata['help']} (default {field.default})")
    _json_option(p, "--project: also write the estimate as JSON here")
    _overrides_option(p)


def _cmd_scaling(args) -> int:
    from tqdm import tqdm

    from agentgym_mega.cluster import Placement
    from agentgym_mega.config import load_config
    from agentgym_mega.scaling import projection, report, sweep

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
        _write_json(args.json, result)
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


def _add_make_tiny_model(sub) -> None:
    p = _command(
        sub, "make-tiny-model", func=_cmd_make_tiny_model,
        help="write a tiny random-init Qwen2/Llama HF model with a BPE tokenizer",
        description=(
            "Writes a Hugging Face model directory that transformers and vLLM both load: random\n"
            "weights, a byte-level BPE tokenizer trained on environment text, and a Qwen-style chat\n"
            "template (<|im_start|>role ... <|im_end|>). For tests and CPU demos, where no weights\n"
            "can be downloaded. head_dim = hidden/heads must be a multiple of 32 (vLLM CPU attention)."
        ),
    )
    p.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"],
                   help="qwen2: tied embeddings, QKV bias; llama: untied, no bias")
    p.add_argument("--out", required=True, help="output directory")
    _add_shape_args(p, kv_heads=1, vocab=512)


def _cmd_make_tiny_model(args) -> int:
    from agentgym_mega.models.tiny import TinySpec, make_tiny_model

    spec = TinySpec(
        arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, vocab=args.vocab, ffn=args.ffn, seed=args.seed,
    )
    _validate_spec(spec)
    print(f"wrote {make_tiny_model(args.out, spec)}")
    return 0


def _add_pretrain_tiny(sub) -> None:
    from agentgym_mega.pretrain import PLAYABLE

    p = _command(
        sub, "pretrain-tiny", func=_cmd_pretrain_tiny,
        help="pretrain a tiny base policy on random valid play (knows the format, not the strategy)",
        description=(
            "Plays --episodes episodes of the environment with uniformly random valid replies on\n"
            "train-split tasks (of --categories), trains a byte-level BPE tokenizer on them (merging\n"
            "across words, so action phrases become single tokens) and fits a tiny Llama by\n"
            "next-token loss on the assistant replies only. The replies are the environment's own\n"
            "format: BabyAI `Action: <a listed action>`; Deep Search `<think>...</think>` then\n"
            "`<search>2-5 words of the question</search>` or, once passages are shown, half the\n"
            "time `<answer>a shown passage's title</answer>`. The result is an HF directory for\n"
            "`train` (model.path): a policy that answers in the action format about as well as\n"
            "random valid play, for RL to improve on. Writes pretrain.json beside it."
        ),
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--env", default="babyai", choices=PLAYABLE, help="environment (one random play knows)")
    p.add_argument("--categories", type=lambda s: [c for c in s.split(",") if c],
                   help="comma-separated task categories (BabyAI level names; Deep Search data sources, "
                        "e.g. single,twohop); default all")
    p.add_argument("--episodes", type=_COUNT, default=2000)
    p.add_argument("--epochs", type=_COUNT, default=2)
    p.add_argument("--max-turns", type=_COUNT, default=6, help="turns per episode")
    p.add_argument("--batch-size", type=_COUNT, default=32, help="episodes per step")
    p.add_argument("--lr", type=float, default=5e-3, help="peak AdamW rate (cosine decay to 0)")
    _add_shape_args(p, kv_heads=2, vocab=1024)


def _cmd_pretrain_tiny(args) -> int:
    import torch

    from agentgym_mega.models.tiny import TinySpec
    from agentgym_mega.pretrain import PretrainConfig, pretrain
    from agentgym_mega.rollout.tasks import select_tasks
    from envs import load_kind

    tasks = select_tasks(load_kind(args.env).tasks(), "train", None, args.categories, key="--categories")
    spec = TinySpec(arch="llama", layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                    vocab=args.vocab, ffn=args.ffn, init_std=0.02, seed=args.seed)
    _validate_spec(spec)
    torch.set_num_threads(os.cpu_count() or 1)
    cfg = PretrainConfig(env=args.env, task_ids=[t.id for t in tasks], episodes=args.episodes, max_turns=args.max_turns,
                         epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, vocab=args.vocab, seed=args.seed)
    summary = pretrain(args.out, spec, cfg)
    print(f"wrote {args.out}: loss {summary['final_loss']:.3f} after {summary['steps']} steps, "
          f"{summary['seconds']:.0f}s")
    return 0


def _add_doctor(sub) -> None:
    p = _command(
        sub, "doctor", func=_cmd_doctor,
        help="check that megatron-core trains and vLLM generates on this machine",
        description=(
            "megatron: trains a small megatron-core GPTModel for a few steps at each layout on local\n"
            "ranks (NCCL on GPU, gloo on CPU) with megatron's DDP, distributed optimizer and grad\n"
            "clipping; passes when the loss falls, every rank reports the same loss, and the grad\n"
            "norm after clipping is at most the threshold.\n"
            "vllm: loads --model in vLLM, generates greedily, and compares vLLM's log-probs with\n"
            "transformers' on the same tokens (passes at max abs difference <= 1e-4, fp32)."
        ),
    )
    p.add_argument("--checks", default="megatron,vllm", type=_checks,
                   help="comma list of megatron, vllm (default both)")
    p.add_argument("--layouts", default="tp2,pp2,dp2", type=_layouts,
                   help="megatron layouts; tpN, ppN and dpN each run on N local ranks "
                        "(default tp2,pp2,dp2)")
    p.add_argument("--steps", type=_COUNT, default=6, help="training steps per layout")
    p.add_argument("--model", help="HF model directory for the vllm check (default: a fresh tiny model)")
    _json_option(p, _REPORT_JSON)


def _cmd_doctor(args) -> int:
    from agentgym_mega import doctor

    report = {}
    if "megatron" in args.checks:
        report["megatron"] = doctor.megatron_report(args.layouts, args.steps)
    if "vllm" in args.checks:
        report["vllm"] = doctor.vllm_report(args.model)
    _write_json(args.json, report)
    failed = [name for name, part in report.items() if not part["ok"]]
    print("doctor: " + ("all checks passed" if not failed else "FAILED: " + ", ".join(failed)))
    return 1 if failed else 0


def _add_env_server(sub) -> None:
    p = _command(
        sub, "env-server", func=_cmd_env_server,
        help="serve one environment kind (textcraft, babyai, sciworld, deepsearch, webarena) over HTTP",
        description=(
            "Hosts many instances of one environment in one process behind the AgentGym HTTP\n"
            "protocol (POST /create, /reset, /step, /close; GET /observation), so existing\n"
            "AgentGym clients work unchanged, plus POST /batch (many operations in one round trip),\n"
            "GET /health and GET /tasks. A step's action may be a whole model reply: the text after\n"
            "its last `Action:` is used (deepsearch: its first <search> or <answer> tag pair;\n"
            "webarena: the first action in triple backticks).\n"
            "Every reset/step answer adds episode_score (0-1) and success.\n"
            "Live instances are capped by memory: --memory-share of the memory available at start-up\n"
            "divided by one instance's measured cost (SciWorld 384 MiB, WebArena 128 MiB, BabyAI 64 KiB,\n"
            "Deep Search 16 KiB, TextCraft 8 KiB);\n"
            "--max-instances can only lower that. Past the cap /create answers 503 (server full);\n"
            "instances idle for --idle-timeout seconds are closed (a SciWorld JVM is ended).\n"
            "With a secret (--secret-file, or $AGENTGYM_MEGA_SECRET) every request but GET /health\n"
            "needs `Authorization: Bearer <secret>` (else 401). A --host other than loopback needs a\n"
            "secret unless --insecure."
        ),
    )
    p.add_argument("--env", required=True, choices=KINDS, help="environment kind to serve")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=36001, help="port to bind (default 36001)")
    p.add_argument("--max-instances", type=_COUNT, default=None,
                   help="cap on live instances, below the memory cap (default: the memory cap)")
    p.add_argument("--memory-share", type=_bounded(float, 0, "a fraction in (0, 1]"), default=None,
                   help=f"share of the memory available at start-up that instances may fill (default "
                        f"${limits.MEMORY_SHARE_ENV}, else {limits.MEMORY_SHARE}); servers sharing a machine "
                        "should split it")
    p.add_argument("--idle-timeout", type=_bounded(float, 0, "a number of seconds > 0"), default=600.0,
                   help="close instances unused for this many seconds (default 600)")
    _add_server_security(p)
    p.add_argument("--max-batch-ops", type=_COUNT, default=limits.MAX_BATCH_OPS,
                   help="most operations in one POST /batch; more answers 413 (default %(default)s)")
    p.add_argument("--max-action-chars", type=_COUNT, default=limits.MAX_ACTION_CHARS,
                   help="longest action in characters; longer answers 400 (default %(default)s)")
    from envs.deepsearch.options import Options as DeepSearch
    from envs.webarena.options import SITES
    from envs.webarena.options import Options as WebArena

    p.add_argument("--option", action="append", default=[], type=_key_value, metavar="KEY=VALUE",
                   help="an option of the environment kind, repeatable (deepsearch: "
                        f"{', '.join(DeepSearch.__dataclass_fields__)}; webarena: "
                        f"{', '.join(k for k in WebArena.__dataclass_fields__ if k != 'sites')}; see the README)")
    p.add_argument("--site", action="append", default=[], type=_key_value, metavar="NAME=URL",
                   help=f"webarena: the URL of a site its tasks name, repeatable ({', '.join(SITES)}); "
                        "shopping defaults to the shipped shop, started by the server")


def _add_server_security(p) -> None:
    """What every server of ours takes: a cap on request bodies, the shared secret, --insecure."""
    p.add_argument("--max-body-bytes", type=_COUNT, default=limits.MAX_BODY_BYTES,
                   help="largest request body; larger answers 413 (default %(default)s)")
    p.add_argument("--secret-file", help="file holding the shared secret clients must send as a Bearer token "
                                         f"(default: ${limits.SECRET_ENV}, else no authentication)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a --host other than loopback without a secret")


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE, e.g. retriever_url=http://127.0.0.1:8000")
    return key.strip(), value


def _env_options(args) -> dict:
    options = dict(args.option)
    if args.site:
        if args.env != "webarena":
            raise BadInput(f"--site is an option of webarena, not of {args.env}")
        options["sites"] = {**options.get("sites", {}), **dict(args.site)}
    return options


def _cmd_env_server(args) -> int:
    from envs.server import make_server, read_secret_file

    try:
        secret = read_secret_file(args.secret_file) if args.secret_file else None
        server = make_server(args.env, args.host, args.port, args.max_instances, args.idle_timeout,
                             secret=secret, insecure=args.insecure, memory_share=args.memory_share,
                             max_body_bytes=args.max_body_bytes, max_batch_ops=args.max_batch_ops,
                             max_action_chars=args.max_action_chars, env_options=_env_options(args))
    except ValueError as exc:  # a setting that is not allowed (make_server names it)
        raise BadInput(str(exc)) from None
    state = server.config.app.state
    print(f"serving {args.env} on http://{args.host}:{args.port} (cap {state.pool.max_instances} instances: "
          f"{state.pool.cap_reason}; idle timeout {args.idle_timeout:g} s; "
          f"authentication {'on' if state.secured else 'off'})", file=sys.stderr, flush=True)
    server.run()
    return 0


# `retriever`: Deep Search's passage index and the server in front of it.

def _add_retriever(sub) -> None:
    from envs.deepsearch import retriever

    p = _command(
        sub, "retriever",
        help="build a Deep Search retriever index (BM25, optionally dense) or serve one over HTTP",
        description=(
            "build: indexes a Search-R1/FlashRAG passage corpus into a directory.\n"
            "serve: answers POST /retrieve from such a directory in Search-R1's retrieval-server format.\n"
            "Environments take the directory (in-process) or the server's URL alike."
        ),
    )
    commands = p.add_subparsers(dest="action", required=True, metavar="<build|serve>")
    b = _command(
        commands, "build", func=_cmd_retriever_build,
        help="index a passage corpus with BM25 (and a dense encoder with --dense-model)",
        description=(
            "Reads --corpus (JSONL, one {\"id\", \"contents\"} per line, contents the title, a newline,\n"
            "then the text: Search-R1's and FlashRAG's corpora) and writes --out: bm25s's BM25 index\n"
            "(lower case, English stopwords, no stemmer), the passages (read memory-mapped) and\n"
            "retriever.json; with --dense-model also a FAISS flat inner-product index of the passages\n"
            "encoded by that local sentence-transformers directory (e5 style: `passage: ` prefix, the\n"
            "model's own pooling, normalised; queries get `query: `). Nothing is downloaded. The index\n"
            "is built beside --out and moved into place once complete: a line that is not JSON, lacks\n"
            "id or contents or repeats an id exits 2 naming the file and line, and writes nothing.\n"
            "Prints the passages, seconds, passages/s and the size on disk."
        ),
    )
    b.add_argument("--corpus", required=True, help="passage corpus, JSONL")
    b.add_argument("--out", required=True, help="index directory to write (replaced once the build completes)")
    b.add_argument("--dense-model", help="local sentence-transformers directory (e.g. a saved intfloat/e5-base-v2): "
                                         "also build the dense index")
    b.add_argument("--batch-size", type=_COUNT, default=64, help="passages per encoder batch (default 64)")
    b.add_argument("--device", choices=_DEVICES, help="where the encoder runs (default: cuda when torch sees "
                                                             "a GPU, else cpu)")
    s = _command(
        commands, "serve", func=_cmd_retriever_serve,
        help="serve an index over HTTP (Search-R1's POST /retrieve)",
        description=(
            "Loads --index memory-mapped and answers POST /retrieve {\"queries\": [...], \"topk\": 3,\n"
            "\"return_scores\": true} with {\"result\": [[{\"document\": {\"id\", \"contents\"}, \"score\": s},\n"
            "...], ...]} (without return_scores: the documents alone), best first, as Search-R1's\n"
            "retrieval server does; GET /health reports the passages, the mode and the limits. A\n"
            "request over --max-queries, --max-topk or --max-query-chars answers 400, a body over\n"
            "--max-body-bytes 413. With a secret (--secret-file, or $AGENTGYM_MEGA_SECRET) every\n"
            "request but GET /health needs `Authorization: Bearer <secret>` (else 401). A --host\n"
            "other than loopback needs a secret unless --insecure."
        ),
    )
    s.add_argument("--index", required=True, help="index directory from `agentgym-mega retriever build`")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=_port, default=8000, help="port to bind (default 8000)")
    s.add_argument("--mode", choices=retriever.MODES, help="default: dense when the index has it, else bm25")
    s.add_argument("--device", choices=_DEVICES, help="where the dense query encoder runs (default: cuda "
                                                             "when torch sees a GPU, else cpu)")
    _add_server_security(s)
    s.add_argument("--max-queries", type=_COUNT, default=retriever.MAX_QUERIES,
                   help="most queries in one request; more answers 400 (default %(default)s)")
    s.add_argument("--max-topk", type=_COUNT, default=retriever.MAX_TOPK,
                   help="largest topk; larger answers 400 (default %(default)s)")
    s.add_argument("--max-query-chars", type=_COUNT, default=retriever.MAX_QUERY_CHARS,
                   help="longest query in characters; longer answers 400 (default %(default)s)")


def _cmd_retriever_build(args) -> int:
    from envs.deepsearch.retriever import RetrieverInputError, build_index

    try:
        report = build_index(args.corpus, args.out, args.dense_model, args.batch_size, device=args.device)
    except RetrieverInputError as exc:
        raise BadInput(str(exc)) from None
    print(f"indexed {report['passages']} passages ({', '.join(report['indexes'])}) into {args.out} in "
          f"{report['seconds']:.1f} s: {report['passages_per_s']:.0f} passages/s, "
          f"{report['bytes'] / 2**20:.2f} MiB on disk")
    return 0


def _cmd_retriever_serve(args) -> int:
    from envs.deepsearch.retriever_server import make_server
    from envs.server import read_secret_file

    try:
        secret = read_secret_file(args.secret_file) if args.secret_file else None
        server = make_server(args.index, args.host, args.port, args.mode, device=args.device, secret=secret,
                             insecure=args.insecure, max_body_bytes=args.max_body_bytes, max_queries=args.max_queries,
                             max_topk=args.max_topk, max_query_chars=args.max_query_chars)
    except ValueError as exc:  # a setting, index or mode that is not allowed (the message names it)
        raise BadInput(str(exc)) from None
    state = server.config.app.state
    print(f"serving the {state.retriever.mode} retriever over {len(state.retriever)} passages on "
          f"http://{args.host}:{args.port} (authentication {'on' if state.secured else 'off'})",
          file=sys.stderr, flush=True)
    server.run()
    return 0


# `bench`: each benchmark is a module of agentgym_mega.bench whose run(...) returns its report.

def _add_bench(sub) -> None:
    p = _command(
        sub, "bench", func=_cmd_bench,
        help="benchmarks; each prints its figures and writes a JSON report",
        description=(
            "Speed is measured here, never in tests. Each benchmark prints its figures and, with\n"
            "--json PATH, writes them as JSON. Timings on shared CPU machines are indicative.\n"
            "  train     forward+backward tokens/s: megatron actor at TP=1 and TP=2 vs transformers\n"
            "  rollout   episodes/s of a long-tailed multi-turn workload, lockstep vs async rollout\n"
            "  engine    generation tokens/s through the engine wrapper vs vLLM called directly\n"
            "  sync      weight sync GB/s megatron -> vLLM vs the raw ZMQ rate, and log-prob parity;\n"
            "            or, with --receivers/--transport, zmq vs collective to 1..N receivers\n"
            "  env       environment server steps/s and latency, per-request vs batched\n"
            "  learn     held-out success before and after RL on the CPU demo's task, per estimator\n"
            "  startup   host memory and time of building and loading a rank's shard, TP=1 vs TP=2"
        ),
    )
    benches = p.add_subparsers(dest="bench", required=True, metavar="<benchmark>")
    for add in (_add_bench_train, _add_bench_rollout, _add_bench_engine, _add_bench_sync, _add_bench_env,
                _add_bench_learn, _add_bench_startup):
        add(benches)


def _cmd_bench(args) -> int:
    report = args.run(args)
    _write_json(args.json, report)
    print(json.dumps(report, indent=2))
    return 0


def _bench(name: str):
    """Imported only when it runs: the benchmarks pull in megatron, vLLM or the environments."""
    return importlib.import_module(f"agentgym_mega.bench.{name}")


def _add_bench_train(benches) -> None:
    b = _command(
        benches, "train", run=_run_bench_train,
        help="forward+backward tokens/s: megatron actor (TP=1, TP=2) vs transformers",
        description=(
            "Builds a tiny Qwen2 model and times forward+backward of the mean next-token NLL on the\n"
            "same batch with transformers and with the megatron-core actor at TP=1 and TP=2 (local\n"
            "gloo ranks on CPU), one thread per process. Every side runs in a fresh process, in\n"
            "alternating rounds; reports tokens/s from the median step, the ratios and each round's,\n"
            "and the same per core (TP=2 runs on two cores, transformers and TP=1 on one).\n"
            "Without options it measures the figure docs/results.md tracks (4 layers, hidden 256, 8\n"
            "heads, 2 KV heads, vocab 2048, 4 x 256 tokens); the options below change one part of that\n"
            "to see how the ratio moves with the model's size."
        ),
    )
    for name, what in (("layers", "decoder layers"), ("hidden", "hidden size"), ("heads", "attention heads"),
                       ("kv-heads", "key/value heads (even: TP=2 splits them)"), ("vocab", "vocabulary size"),
                       ("ffn", "MLP width (default 3 x hidden)"), ("batch", "sequences per step"),
                       ("seq", "tokens per sequence"), ("rounds", "alternating rounds (default 3)")):
        b.add_argument(f"--{name}", type=_COUNT, default=None, help=what)
    _json_option(b, _BENCH_JSON)


def _run_bench_train(args) -> dict:
    bench = _bench("train")
    spec = bench.BenchSpec()

    def given(*names: str) -> dict:  # the options given on the command line
        return {n: getattr(args, n) for n in names if getattr(args, n) is not None}

    model = dataclasses.replace(spec.model, **given("layers", "hidden", "heads", "kv_heads", "vocab", "ffn"))
    _validate_spec(model)
    from agentgym_mega.models import gpt, mapping

    try:  # the TP=2 side's split, refused here rather than in its ranks
        gpt.check_split(model.layers, model.kv_heads, model.mlp_width, tp=2, pp=1)
    except mapping.MappingError as exc:
        raise BadInput(str(exc)) from None
    return bench.run(dataclasses.replace(spec, model=model, **given("batch", "seq", "rounds")))


def _add_bench_rollout(benches) -> None:
    b = _command(
        benches, "rollout",
        run=lambda a: _bench("rollout").run(a.mode, a.workload, a.tasks, a.n_per_task, a.latency_ms, a.repeats,
                                            a.model, a.group_window_ms),
        help="episodes/s of a long-tailed multi-turn workload, lockstep vs async rollout",
        description=(
            "Runs the same episodes (same tasks, seeds and weights) through each --mode of the rollout\n"
            "manager and reports a row per mode: episodes_per_s, engine_busy_fraction (the share of\n"
            "the wall time the engine had a request in flight) and seconds, medians of --repeats runs,\n"
            "plus the speedup over lockstep and whether every mode returned the same tokens.\n"
            "Workload `mixed`: the CPU demo's three BabyAI levels with turn caps 2, 4, 6 and 10 in\n"
            "turn, played by the demo's tiny base policy (pretrained first when missing) through a\n"
            "real BabyAI server and one vLLM engine, each env step delayed by a log-normal latency\n"
            "(median --latency-ms, sigma 1, at most 1 s; a batched step waits for its slowest item)."
        ),
    )
    _json_option(b, _BENCH_JSON)
    b.add_argument("--mode", type=_names(("lockstep", "async"), "mode(s)"), default=["lockstep", "async"],
                   help="comma-separated modes to compare (default: lockstep,async)")
    b.add_argument("--workload", choices=["mixed"], default="mixed")
    b.add_argument("--tasks", type=_COUNT, default=24, help="tasks (groups) per run (default: 24)")
    b.add_argument("--n-per-task", type=_COUNT, default=4, help="episodes per task (default: 4)")
    b.add_argument("--latency-ms", type=float, default=40.0,
                   help="median of the added env step latency, ms; 0 for none (default: 40)")
    b.add_argument("--repeats", type=_COUNT, default=3)
    b.add_argument("--model", help="HF model directory (default: the demo's base policy, runs/demo/base)")
    b.add_argument("--group-window-ms", type=float, default=None,
                   help="async: rollout.env_group_window_ms (default: the config's, 0: each step alone)")


def _add_bench_engine(benches) -> None:
    b = _command(
        benches, "engine",
        run=lambda a: _bench("engine").run(a.model, a.prompts, a.prompt_len, a.max_tokens, a.rounds),
        help="generation tokens/s through the engine wrapper vs vLLM called directly",
        description=(
            "Runs the same token-id requests through VLLMEngine.generate and through vLLM's\n"
            "AsyncLLM.generate on one engine, alternating rounds with the prefix cache reset, and\n"
            "reports tokens/s of each and the wrapper's overhead in percent."
        ),
    )
    _json_option(b, _BENCH_JSON)
    b.add_argument("--model", help="HF model directory (default: a fresh tiny Qwen2)")
    b.add_argument("--prompts", type=_COUNT, default=32)
    b.add_argument("--prompt-len", type=_COUNT, default=128)
    b.add_argument("--max-tokens", type=_COUNT, default=64)
    b.add_argument("--rounds", type=_COUNT, default=5)


def _add_bench_sync(benches) -> None:
    b = _command(
        benches, "sync", run=_run_bench_sync,
        help="weight sync GB/s megatron -> vLLM vs the raw ZMQ rate, and log-prob parity; or transport scaling",
        description=(
            "Two modes.\n"
            "\n"
            "megatron -> vLLM (the default: neither --receivers nor --transport given): streams a\n"
            "~104M-parameter Qwen2 from megatron-core ranks (gathered over TP) into a vLLM engine that\n"
            "started from different weights, then, --repeats times, takes an optimizer step and syncs\n"
            "again, as training does. Measures the raw ZMQ rate of the same bytes between two processes\n"
            "and compares vLLM's log-probs with the trainer's. Reports params, bytes, seconds and gbps\n"
            "(median of the repeats; the first sync, which also pays vLLM's one-time weight repacking,\n"
            "as first_*), ceiling_gbps and the log-prob differences. Options:\n"
            "--tp, --bucket-mb, --repeats.\n"
            "\n"
            "transport scaling (--receivers and/or --transport; no megatron, no vLLM): a synthetic model\n"
            "of --size-mb MiB goes from a sender process to N receiver processes over each transport:\n"
            "zmq (a full copy to each receiver over tcp://) and collective (a gloo chain: the sender\n"
            "sends one copy, each receiver forwards it to the next). After one untimed warm-up sync\n"
            "(which also connects or builds the group), --repeats timed syncs. One row per transport\n"
            "and receiver count: seconds (median per sync, push to every receiver's ACK/vote),\n"
            "sender_bytes (median bytes that left the sender per sync, from its TCP sockets' counters),\n"
            "model_bytes, sender_bytes_ratio and gbps_per_receiver. All processes share this machine's\n"
            "cores, so seconds growing with receivers here mostly measures that; sender_bytes is what\n"
            "the transport decides. Options: --receivers (default 1,2,4), --transport (default\n"
            "zmq,collective), --size-mb, --bucket-mb, --repeats."
        ),
    )
    _json_option(b, _BENCH_JSON)
    b.add_argument("--tp", type=_COUNT, default=2, help="megatron mode: trainer tensor-parallel size (ranks)")
    b.add_argument("--bucket-mb", type=_COUNT, default=64, help="bucket size in MiB")
    b.add_argument("--repeats", type=_COUNT, default=3,
                   help="timed syncs after the first (default 3); megatron mode: each after an optimizer step")
    b.add_argument("--receivers", type=_concurrency, default=None,
                   help="transport mode: comma list of receiver counts (default 1,2,4)")
    b.add_argument("--transport", type=_names(_SYNC_TRANSPORTS, "transport(s)"), default=None,
                   help=f"transport mode: comma list of {', '.join(_SYNC_TRANSPORTS)} (default both)")
    b.add_argument("--size-mb", type=_COUNT, default=None,
                   help="transport mode: synthetic model size in MiB (default 256)")


def _run_bench_sync(args) -> dict:
    sync = _bench("sync")
    if args.receivers is None and args.transport is None:
        if args.size_mb is not None:
            raise BadInput("--size-mb sizes the transport mode's model: pass --receivers and/or --transport "
                           "with it (the megatron -> vLLM mode syncs a fixed ~104M-parameter model)")
        return sync.run(args.tp, args.bucket_mb, args.repeats)
    return sync.run_transports(args.receivers or [1, 2, 4], args.transport or list(_SYNC_TRANSPORTS),
                               args.size_mb or 256, args.bucket_mb, args.repeats)


def _add_bench_env(benches) -> None:
    b = _command(
        benches, "env", run=lambda a: _bench("env").run(a.env, a.concurrency, a.steps),
        help="environment server throughput, per-request vs batched",
        description=(
            "Starts an env server through this CLI and, for each concurrency, runs that many\n"
            "episodes (create, reset, --steps steps, close) through the per-request AgentGym path\n"
            "(one HTTP call per step, one client thread per episode) and through the batched path\n"
            "(one /batch call per round). Reports steps/s and p50/p99 step latency per concurrency\n"
            "and path, the server's RSS before and after, and the batched/per-request ratio.\n"
            "SciWorld starts one JVM (~200 MB) per episode: keep its concurrency small."
        ),
    )
    b.add_argument("--env", required=True, choices=KINDS, help="environment kind to measure")
    b.add_argument("--concurrency", type=_concurrency, default=[1, 16, 64, 256],
                   help="comma list of concurrent episodes (default 1,16,64,256)")
    b.add_argument("--steps", type=_COUNT, default=20, help="steps per episode")
    _json_option(b, _BENCH_JSON)


def _add_bench_learn(benches) -> None:
    b = _command(
        benches, "learn", run=_run_bench_learn,
        help="held-out success before and after RL on the CPU demo's task, for one estimator",
        description=(
            "Trains the CPU demo (configs/demo_cpu.yaml: three BabyAI levels, the tiny base policy,\n"
            "pretrained first if runs/demo/base is missing) with --estimator for --steps steps, the\n"
            "turn-cap stages and evaluations kept at the demo's fractions of the run, and reports\n"
            "held-out success (and Avg@n) at the start and the end: estimator, steps, start_success,\n"
            "end_success, and steps_per_hour over the steps' own time (start-up and evaluations left\n"
            "out). --set KEY=VALUE (repeatable) changes the demo's config, e.g. rollout.mode=async or\n"
            "cluster.placement=split trainer.off_policy_steps=1. About 15 minutes for 160 steps on 2\n"
            "cores (gae more: it trains a critic).\n"
            "--off-policy-arms: instead, steps/hour of three arms, --rounds times each, interleaved,\n"
            "evaluations off: lockstep, lockstep with the old-log-prob pass skipped\n"
            "(algorithm.old_logprobs=engine) and one-step off-policy, which both skips the pass and\n"
            "overlaps the next rollout with the update: speedup_vs_lockstep and overlap_speedup."
        ),
    )
    b.add_argument("--estimator", required=True, choices=("gae", "grpo", "reinforce_pp", "rloo"))
    b.add_argument("--steps", type=_COUNT, default=160, help="training steps (default 160, the demo's)")
    b.add_argument("--output-dir", help="the run's directory (default runs/bench-learn/ESTIMATOR); must not hold a run")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override on top of the demo's (repeatable)")
    b.add_argument("--off-policy-arms", action="store_true",
                   help="compare lockstep, lockstep without the old-log-prob pass, and one-step off-policy")
    b.add_argument("--rounds", type=_COUNT, default=2, help="--off-policy-arms: runs of each arm (default 2)")
    _json_option(b, _BENCH_JSON)


def _run_bench_learn(args) -> dict:
    learn = _bench("learn")
    if args.off_policy_arms:
        return learn.compare_off_policy(args.estimator, args.steps, args.rounds,
                                        args.output_dir or os.path.join("runs", "bench-learn", "off-policy-arms"),
                                        args.set)
    return learn.run(args.estimator, args.steps, args.output_dir or os.path.join("runs", "bench-learn", args.estimator),
                     args.set)


def _add_bench_startup(benches) -> None:
    b = _command(
        benches, "startup", run=lambda a: _bench("startup").run(a.model, a.trainable),
        help="host memory and time of a rank's start-up (build + load its shard), TP=1 vs TP=2",
        description=(
            "Builds the megatron actor from an HF directory on one rank and on two TP ranks (local\n"
            "gloo ranks) and reports, per rank, the host memory the start-up adds (peak RSS over RSS\n"
            "before it, after the imports), the shard's bytes and the seconds; and tp2_share_of_tp1,\n"
            "the larger TP=2 rank's figure over the TP=1 one (0.5 is ideal: each rank reads and holds\n"
            "only its half). Default model: a fresh ~95M-parameter tiny Llama (fp32)."
        ),
    )
    _json_option(b, _BENCH_JSON)
    b.add_argument("--model", help="HF model directory (default: a fresh ~95M-parameter Llama)")
    b.add_argument("--trainable", action="store_true",
                   help="build the trainable actor (gradient buffers, optimizer) rather than the frozen one")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentgym-mega",
        description="Multi-turn agentic RL (AgentGym-RL, ScalingInter-RL) on megatron-core + vLLM.",
        epilog="Run `agentgym-mega <command> --help` for each command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="<command>")
    for add in (_add_config, _add_train, _add_eval, _add_plan, _add_scaling, _add_make_tiny_model, _add_pretrain_tiny,
                _add_doctor, _add_env_server, _add_retriever, _add_bench):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BadInput as exc:
        print(f"agentgym-mega {args.command}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
