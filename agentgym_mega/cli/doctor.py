"""`agentgym-mega doctor`: megatron-core trains and vLLM generates on this machine."""

from __future__ import annotations

import argparse
import re

from agentgym_mega.cli.options import COUNT, REPORT_JSON, command, json_option, write_json

# agentgym_mega.doctor is imported when the command runs: it pulls in torch, which --help should
# not pay for.


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


def add(sub) -> None:
    p = command(
        sub, "doctor", func=run,
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
    p.add_argument("--steps", type=COUNT, default=6, help="training steps per layout")
    p.add_argument("--model", help="HF model directory for the vllm check (default: a fresh tiny model)")
    json_option(p, REPORT_JSON)


def run(args) -> int:
    from agentgym_mega import doctor

    report = {}
    if "megatron" in args.checks:
        report["megatron"] = doctor.megatron_report(args.layouts, args.steps)
    if "vllm" in args.checks:
        report["vllm"] = doctor.vllm_report(args.model)
    write_json(args.json, report)
    failed = [name for name, part in report.items() if not part["ok"]]
    print("doctor: " + ("all checks passed" if not failed else "FAILED: " + ", ".join(failed)))
    return 1 if failed else 0

