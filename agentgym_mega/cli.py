"""`agentgym-mega`: one subcommand per capability. Each parses its arguments and calls one function."""

from __future__ import annotations

import argparse
import json
import re
import sys

from agentgym_mega.config import ConfigError

EXIT_BAD_INPUT = 2


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


def _cmd_make_tiny_model(args) -> int:
    from agentgym_mega.models.tiny import TinySpec, make_tiny_model

    spec = TinySpec(
        arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, vocab=args.vocab, ffn=args.ffn, seed=args.seed,
    )
    try:
        spec.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    print(f"wrote {make_tiny_model(args.out, spec)}")
    return 0


def _write_json(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)


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


def _cmd_bench(args) -> int:
    import importlib

    report = importlib.import_module(f"agentgym_mega.bench.{args.bench}").run()
    _write_json(args.json, report)
    return 0


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentgym-mega",
        description="Multi-turn agentic RL (AgentGym-RL, ScalingInter-RL) on megatron-core + vLLM.",
        epilog="Run `agentgym-mega <command> --help` for each command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="<command>")
    fmt = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser(
        "config", formatter_class=fmt,
        help="validate a config and print it with includes and overrides applied",
        description=(
            "Loads a YAML config (following its `include:` files), applies dotted overrides such as\n"
            "trainer.total_steps=50 or horizon.caps=[6,13,20], validates every key, and prints the\n"
            "resolved config. Exit code 2 and a message naming the key on any invalid value."
        ),
    )
    p.add_argument("--config", help="YAML file; omitted: the built-in defaults")
    p.add_argument("--out", help="write the resolved YAML here instead of stdout")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser(
        "make-tiny-model", formatter_class=fmt,
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
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1, help="key/value heads (GQA); divides --heads")
    p.add_argument("--vocab", type=int, default=512, help="BPE vocabulary and model vocab size")
    p.add_argument("--ffn", type=int, default=None, help="MLP width (default 3 x hidden)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd_make_tiny_model)

    p = sub.add_parser(
        "doctor", formatter_class=fmt,
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
    p.add_argument("--steps", type=int, default=6, help="training steps per layout")
    p.add_argument("--model", help="HF model directory for the vllm check (default: a fresh tiny model)")
    p.add_argument("--json", help="also write the report as JSON here")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser(
        "bench", formatter_class=fmt,
        help="benchmarks; each prints its figures and writes a JSON report",
        description=(
            "Speed is measured here, never in tests. Each benchmark prints its figures and, with\n"
            "--json PATH, writes them as JSON.\n"
            "  train   forward+backward tokens/s: megatron actor at TP=1 and TP=2 vs transformers\n"
            "Timings on shared CPU machines are indicative."
        ),
    )
    benches = p.add_subparsers(dest="bench", required=True, metavar="<benchmark>")
    b = benches.add_parser(
        "train", formatter_class=fmt,
        help="forward+backward tokens/s: megatron actor (TP=1, TP=2) vs transformers",
        description=(
            "Builds a tiny Qwen2 model and times forward+backward of the mean next-token NLL on the\n"
            "same batch with transformers and with the megatron-core actor at TP=1 and TP=2 (local\n"
            "gloo ranks on CPU), one thread per process; reports tokens/s and the ratios."
        ),
    )
    b.add_argument("--json", help="write the report here")
    b.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"agentgym-mega {args.command}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
