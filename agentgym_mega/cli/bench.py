"""`agentgym-mega bench`: each benchmark is a module of agentgym_mega.bench whose run(...) returns its report."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os

from agentgym_mega.cli.options import (
    BENCH_JSON,
    COUNT,
    command,
    counts,
    json_option,
    name_list,
    require_hf_dir,
    validate_spec,
    write_json,
)
from agentgym_mega.errors import BadInput
from envs import KINDS

# Spelled here rather than read from agentgym_mega.bench.sync.TRANSPORTS: --help should not import
# a benchmark. The benchmark modules, and the model code bench train checks its split with, are
# imported when a benchmark runs: they pull in torch, megatron, vLLM or the environments.
SYNC_TRANSPORTS = ("zmq", "collective")


def add(sub) -> None:
    p = command(
        sub, "bench", func=run,
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
            "  learn     held-out success before and after RL on a config's task (the CPU demo's), per estimator\n"
            "  startup   host memory and time of building and loading a rank's shard, TP=1 vs TP=2"
        ),
    )
    benches = p.add_subparsers(dest="bench", required=True, metavar="<benchmark>")
    for add_benchmark in (_add_bench_train, _add_bench_rollout, _add_bench_engine, _add_bench_sync, _add_bench_env,
                          _add_bench_learn, _add_bench_startup):
        add_benchmark(benches)


def run(args) -> int:
    report = args.run(args)
    write_json(args.json, report)
    print(json.dumps(report, indent=2))
    return 0


def _bench(name: str):
    """Imported only when it runs: the benchmarks pull in megatron, vLLM or the environments."""
    return importlib.import_module(f"agentgym_mega.bench.{name}")


def _add_bench_train(benches) -> None:
    b = command(
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
            "to see how the ratio moves with the model's size. --model DIR measures a real model\n"
            "instead (e.g. runs/models/smollm2-135m-instruct, the figure tracked since #41)."
        ),
    )
    for name, what in (("layers", "decoder layers"), ("hidden", "hidden size"), ("heads", "attention heads"),
                       ("kv-heads", "key/value heads (even: TP=2 splits them)"), ("vocab", "vocabulary size"),
                       ("ffn", "MLP width (default 3 x hidden)"), ("batch", "sequences per step"),
                       ("seq", "tokens per sequence"), ("rounds", "alternating rounds (default 3)"),
                       ("warmup", "untimed steps per side and round (default 5)"),
                       ("iters", "timed steps per side and round (default 10)")):
        b.add_argument(f"--{name}", type=COUNT, default=None, help=what)
    b.add_argument("--model", help="a Hugging Face model directory to measure, its own shape and weights, instead "
                                   "of the tiny model (TP=2 left out, with why, where its heads do not split)")
    json_option(b, BENCH_JSON)


def _run_bench_train(args) -> dict:
    bench = _bench("train")
    spec = bench.BenchSpec()

    def given(*names: str) -> dict:  # the options given on the command line
        return {n: getattr(args, n) for n in names if getattr(args, n) is not None}

    shape = given("layers", "hidden", "heads", "kv_heads", "vocab", "ffn")
    run = given("batch", "seq", "rounds", "warmup", "iters")
    if args.model:
        if shape:
            raise BadInput(f"--model {args.model} brings its own shape: leave out "
                           f"{', '.join('--' + n.replace('_', '-') for n in shape)}")
        require_hf_dir("--model", args.model)
        tps, left_out = bench.splits(bench.geometry(args.model))
        return bench.run(dataclasses.replace(spec, model_dir=args.model, tps=tps, **run), left_out)
    model = dataclasses.replace(spec.model, **shape)
    validate_spec(model)
    from agentgym_mega.models import gpt, mapping

    try:  # the TP=2 side's split, refused here rather than in its ranks
        gpt.check_split(model.layers, model.heads, model.kv_heads, model.mlp_width, tp=2, pp=1)
    except mapping.MappingError as exc:
        raise BadInput(str(exc)) from None
    return bench.run(dataclasses.replace(spec, model=model, **run))


def _add_bench_rollout(benches) -> None:
    b = command(
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
    json_option(b, BENCH_JSON)
    b.add_argument("--mode", type=name_list(("lockstep", "async"), "mode(s)"), default=["lockstep", "async"],
                   help="comma-separated modes to compare (default: lockstep,async)")
    b.add_argument("--workload", choices=["mixed"], default="mixed")
    b.add_argument("--tasks", type=COUNT, default=24, help="tasks (groups) per run (default: 24)")
    b.add_argument("--n-per-task", type=COUNT, default=4, help="episodes per task (default: 4)")
    b.add_argument("--latency-ms", type=float, default=40.0,
                   help="median of the added env step latency, ms; 0 for none (default: 40)")
    b.add_argument("--repeats", type=COUNT, default=3)
    b.add_argument("--model", help="HF model directory (default: the demo's base policy, runs/demo/base)")
    b.add_argument("--group-window-ms", type=float, default=None,
                   help="async: rollout.env_group_window_ms (default: the config's, 0: each step alone)")


def _add_bench_engine(benches) -> None:
    b = command(
        benches, "engine",
        run=lambda a: _bench("engine").run(a.model, a.prompts, a.prompt_len, a.max_tokens, a.rounds),
        help="generation tokens/s through the engine wrapper vs vLLM called directly",
        description=(
            "Runs the same token-id requests through VLLMEngine.generate and through vLLM's\n"
            "AsyncLLM.generate on one engine, alternating rounds with the prefix cache reset, and\n"
            "reports tokens/s of each and the wrapper's overhead in percent."
        ),
    )
    json_option(b, BENCH_JSON)
    b.add_argument("--model", help="HF model directory (default: a fresh tiny Qwen2)")
    b.add_argument("--prompts", type=COUNT, default=32)
    b.add_argument("--prompt-len", type=COUNT, default=128)
    b.add_argument("--max-tokens", type=COUNT, default=64)
    b.add_argument("--rounds", type=COUNT, default=5)


def _add_bench_sync(benches) -> None:
    b = command(
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
    json_option(b, BENCH_JSON)
    b.add_argument("--tp", type=COUNT, default=2, help="megatron mode: trainer tensor-parallel size (ranks)")
    b.add_argument("--bucket-mb", type=COUNT, default=64, help="bucket size in MiB")
    b.add_argument("--repeats", type=COUNT, default=3,
                   help="timed syncs after the first (default 3); megatron mode: each after an optimizer step")
    b.add_argument("--receivers", type=counts, default=None,
                   help="transport mode: comma list of receiver counts (default 1,2,4)")
    b.add_argument("--transport", type=name_list(SYNC_TRANSPORTS, "transport(s)"), default=None,
                   help=f"transport mode: comma list of {', '.join(SYNC_TRANSPORTS)} (default both)")
    b.add_argument("--size-mb", type=COUNT, default=None,
                   help="transport mode: synthetic model size in MiB (default 256)")


def _run_bench_sync(args) -> dict:
    sync = _bench("sync")
    if args.receivers is None and args.transport is None:
        if args.size_mb is not None:
            raise BadInput("--size-mb sizes the transport mode's model: pass --receivers and/or --transport "
                           "with it (the megatron -> vLLM mode syncs a fixed ~104M-parameter model)")
        return sync.run(args.tp, args.bucket_mb, args.repeats)
    return sync.run_transports(args.receivers or [1, 2, 4], args.transport or list(SYNC_TRANSPORTS),
                               args.size_mb or 256, args.bucket_mb, args.repeats)


def _add_bench_env(benches) -> None:
    b = command(
        benches, "env", run=lambda a: _bench("env").run(a.env, a.concurrency, a.steps),
        help="environment server throughput, per-request vs batched",
        description=(
            "Starts an env server through this CLI and, for each concurrency, runs that many\n"
            "episodes (create, reset, --steps steps, close) through the per-request AgentGym path\n"
            "(one HTTP call per step, one client thread per episode) and through the batched path\n"
            "(one /batch call per round). Reports steps/s and p50/p99 step latency per concurrency\n"
            "and path, the server's RSS before and after, and the batched/per-request ratio.\n"
            "SciWorld starts one JVM per episode, the heaviest instance of any env: keep its concurrency small."
        ),
    )
    b.add_argument("--env", required=True, choices=KINDS, help="environment kind to measure")
    b.add_argument("--concurrency", type=counts, default=[1, 16, 64, 256],
                   help="comma list of concurrent episodes (default 1,16,64,256)")
    b.add_argument("--steps", type=COUNT, default=20, help="steps per episode")
    json_option(b, BENCH_JSON)


def _add_bench_learn(benches) -> None:
    b = command(
        benches, "learn", run=_run_bench_learn,
        help="held-out success before and after RL on a config's task (the CPU demo's), for one estimator",
        description=(
            "Trains --config's task (default configs/demo_cpu.yaml, the CPU demo: three BabyAI levels,\n"
            "the tiny base policy at its model.path, pretrained first by pretrain-tiny if missing) with\n"
            "--estimator (default: the config's algorithm.estimator) for --steps steps (default: its\n"
            "trainer.total_steps), the turn-cap stages and evaluations kept at the config's fractions of\n"
            "the run, and reports held-out success (and Avg@n) at the start and the end: estimator,\n"
            "steps, start_success, end_success, eval_curve, and steps_per_hour over the steps' own time\n"
            "(start-up and evaluations left out). --set KEY=VALUE (repeatable) changes the config, e.g.\n"
            "rollout.mode=async or cluster.placement=split trainer.off_policy_steps=1. As long as the\n"
            "config's own run (gae longer: it trains a critic).\n"
            "--off-policy-arms: instead, steps/hour of three arms, --rounds times each, interleaved,\n"
            "evaluations off: lockstep, lockstep with the old-log-prob pass skipped\n"
            "(algorithm.old_logprobs=engine) and one-step off-policy, which both skips the pass and\n"
            "overlaps the next rollout with the update: speedup_vs_lockstep and overlap_speedup."
        ),
    )
    b.add_argument("--config", help="the task's training config (default configs/demo_cpu.yaml, the CPU demo's)")
    b.add_argument("--estimator", choices=("gae", "gigpo", "grpo", "reinforce_pp", "rloo"),
                   help="the advantage estimator (default: the config's algorithm.estimator)")
    b.add_argument("--steps", type=COUNT, help="training steps (default: the config's trainer.total_steps, "
                                               "160 for the demo's)")
    b.add_argument("--output-dir", help="the run's directory (default runs/bench-learn/CONFIG/ESTIMATOR, CONFIG the "
                                        "config file's name); must not hold a run")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override on top of the config's (repeatable)")
    b.add_argument("--off-policy-arms", action="store_true",
                   help="compare lockstep, lockstep without the old-log-prob pass, and one-step off-policy")
    b.add_argument("--rounds", type=COUNT, default=2, help="--off-policy-arms: runs of each arm (default 2)")
    json_option(b, BENCH_JSON)


def learn_plan(args) -> dict:
    """bench learn's arguments with the config's defaults filled in: the config's own estimator
    and length where --estimator and --steps are not given, and the run directory."""
    from agentgym_mega.bench.learn import DEMO_CONFIG
    from agentgym_mega.config import load_config

    config = args.config or DEMO_CONFIG
    cfg = load_config(config)
    estimator = args.estimator or cfg.algorithm.estimator
    name = os.path.splitext(os.path.basename(config))[0]
    default_dir = os.path.join("runs", "bench-learn", name, "off-policy-arms" if args.off_policy_arms else estimator)
    return {"config": config, "estimator": estimator, "steps": args.steps or cfg.trainer.total_steps,
            "output_dir": args.output_dir or default_dir, "settings": args.set}


def _run_bench_learn(args) -> dict:
    learn = _bench("learn")
    plan = learn_plan(args)
    if args.off_policy_arms:
        return learn.compare_off_policy(rounds=args.rounds, **plan)
    return learn.run(**plan)


def _add_bench_startup(benches) -> None:
    b = command(
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
    json_option(b, BENCH_JSON)
    b.add_argument("--model", help="HF model directory (default: a fresh ~95M-parameter Llama)")
    b.add_argument("--trainable", action="store_true",
                   help="build the trainable actor (gradient buffers, optimizer) rather than the frozen one")

