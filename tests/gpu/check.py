"""`make gpu-check`'s report, a pytest plugin (`-p tests.gpu.check`): the machine and the stack's
versions first (with CUDA, also megatron's fused paths a model built there runs: gpt.fusions),
then one row per check (passed, failed, skipped) with its seconds and, for a failure or a skip,
why (a check that needs vLLM where it is absent: skipped, "needs vLLM's CUDA build"); then the
totals. Plain text, short enough to paste into an issue."""

from __future__ import annotations

import importlib.metadata as md

import pytest

STACK = ("torch", "vllm", "transformer-engine", "megatron-core", "transformers")
NO_CUDA = "no CUDA device"
_rows: dict[str, dict] = {}


def _reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, "Skipped: why")
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr)
    return text.strip().splitlines()[0] if text.strip() else ""


def pytest_runtest_logreport(report) -> None:
    row = _rows.setdefault(report.nodeid, {"result": "passed", "seconds": 0.0, "why": ""})
    row["seconds"] += report.duration
    if report.skipped and row["result"] == "passed":
        row["result"], row["why"] = "skipped", _reason(report)
    elif report.failed:
        row["result"] = "failed" if report.when == "call" else f"error ({report.when})"
        row["why"] = _reason(report)


def _versions() -> str:
    found = []
    for name in STACK:
        for dist in (name, f"{name}-cpu"):  # vLLM's CPU build is another distribution
            try:
                found.append(f"{dist} {md.version(dist)}")
                break
            except md.PackageNotFoundError:
                continue
        else:
            found.append(f"{name} -")
    return ", ".join(found)


def _device() -> str:
    import torch

    if not torch.cuda.is_available():
        return NO_CUDA
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{len(names)} x {names[0]} (CUDA {torch.version.cuda})"


def _fusions() -> str:
    from agentgym_mega.models import gpt

    try:
        on = [name for name, value in gpt.fusions(cuda=True).items() if value]
    except ImportError as exc:  # megatron-core absent: every megatron check fails on its own row
        return f"fusions unknown ({exc})"
    return "fusions in force: " + (", ".join(on) or "none")


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter) -> None:
    write = terminalreporter.write_line
    write("")
    device = _device()
    write(f"gpu-check: {device}; {_versions()}")
    if device != NO_CUDA:
        write(f"gpu-check: {_fusions()}")
    width = max([len(n) for n in _rows] + [5])
    write(f"{'check':<{width}}  {'result':<14} {'s':>6}  why")
    for nodeid, row in _rows.items():
        write(f"{nodeid:<{width}}  {row['result']:<14} {row['seconds']:>6.1f}  {row['why'][:100]}")
    counts = {}
    for row in _rows.values():
        key = row["result"].split(" ")[0]
        counts[key] = counts.get(key, 0) + 1
    total = sum(r["seconds"] for r in _rows.values())
    write("gpu-check: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f" in {total:.0f} s")
