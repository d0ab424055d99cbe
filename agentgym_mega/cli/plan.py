"""`agentgym-mega plan`: a config's device memory per GPU, and whether it fits."""

from __future__ import annotations

import argparse
import json

from agentgym_mega.cli.options import COUNT, bounded, command, overrides_option
from agentgym_mega.errors import BadInput
from agentgym_mega.memory_reserves import DEFAULT_GPU_GIB, DEFAULT_HOST_GB, FRAGMENTATION

# Imported when the command runs: the planner pulls in torch and Ray, the config schema pydantic;
# --help should pay for none of them.


def add(sub) -> None:
    p = command(
        sub, "plan", func=run,
        help="plan a config's device memory per GPU and say whether it fits (no GPU, no weights)",
        description=(
            "Reads the config (with overrides) and the model's config.json (model.path, else\n"
            "model.architecture; no weights) and prints, per GPU, the bytes of each role: the actor's,\n"
            "reference's and critic's parameters, fp32 gradient buffers, Adam state sharded over DP,\n"
            "activations of one micro-batch (with parallel.recompute) and log-prob peak; the engines'\n"
            "weights and KV cache within rollout.gpu_memory_utilization. Then the peak of each phase of\n"
            "the loop (start-up/resume, rollout, training, weight sync) for the colocated or split\n"
            "placement, against --gpu-mem-gib less each GPU's reserves (a CUDA context per process,\n"
            "NCCL communicator buffers, --fragmentation-reserve), and each node's host memory (vLLM's\n"
            "start-up sleep backing, offloaded trainer state, sync staging) against\n"
            "--host-mem-gb. Bytes are decimal GB (1e9) but for --gpu-mem-gib (2**30, as CUDA reports).\n"
            "A layout that does not fit, or that megatron or vLLM refuses, exits 2 with the reason and\n"
            "up to 3 nearest layouts that fit, as overrides to paste. The model of memory is in\n"
            "agentgym_mega/memory_formulas.py and docs/clusters.md (\"Planning memory\").\n"
            "Then the checkpoint: its bytes, the seconds a save takes at a stated write rate, the\n"
            "trainer's process-group timeout that follows from them, and one step's time from the\n"
            "scaling projection (where it has one for the config); with --stop-lead-s, a warning\n"
            "when a step plus a save would not fit in that lead (agentgym_mega/checkpoint_timing.py)."
        ),
    )
    p.add_argument("--config", required=True, help="YAML config (e.g. configs/recipes/*.yaml)")
    p.add_argument("--gpus-per-node", type=COUNT, default=8, help="GPUs per node (default 8)")
    p.add_argument("--gpu-mem-gib", type=bounded(float, 0, "a number of GiB > 0"),
                   help="capacity of one GPU in GiB as CUDA reports it (default: this machine's GPU where it has "
                        f"one, else {DEFAULT_GPU_GIB}, an H100 80GB)")
    p.add_argument("--fragmentation-reserve", type=_fraction, default=FRAGMENTATION,
                   help=f"share of each GPU kept for allocator fragmentation (default {FRAGMENTATION})")
    p.add_argument("--host-mem-gb", type=bounded(float, 0, "a number of GB > 0"), default=DEFAULT_HOST_GB,
                   help=f"host memory of one node in decimal GB (default {DEFAULT_HOST_GB})")
    p.add_argument("--nodes", type=COUNT, help="nodes available (default: as many as the layout needs)")
    p.add_argument("--checkpoint-write-gbps", type=bounded(float, 0, "a number of GB/s > 0"),
                   help="decimal GB/s a checkpoint is written at over all ranks (default: "
                        "$AGM_CHECKPOINT_WRITE_GBPS, else 1; train reads the variable)")
    p.add_argument("--stop-lead-s", type=bounded(float, 0, "a number of seconds > 0"),
                   help="seconds between Slurm's stop signal and the time limit (default: $AGM_STOP_LEAD_S; "
                        "none: no check)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes) instead of tables")
    overrides_option(p)


def _fraction(text: str) -> float:
    value = bounded(float, 0, "a fraction in (0, 1)")(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction in (0, 1)")
    return value


def run(args) -> int:
    from agentgym_mega import checkpoint_timing, memory_plan
    from agentgym_mega.config import load_config
    from agentgym_mega.memory_reserves import card_gib

    cfg = load_config(args.config, args.overrides)
    hf, source = memory_plan.read_architecture(cfg.model)
    gib = args.gpu_mem_gib or card_gib() or DEFAULT_GPU_GIB
    result = memory_plan.plan(cfg, hf, args.gpus_per_node, gib, args.nodes, source, args.fragmentation_reserve,
                              args.host_mem_gb)
    result["sync_groups"] = sync_groups(cfg, args.gpus_per_node)
    result["stop_lead"] = stop_lead(cfg, hf, args, gib)
    print(json.dumps(result, indent=2) if args.json
          else memory_plan.render(result) + "\n" + checkpoint_timing.render(result["stop_lead"]))
    if not result["fits"]:
        raise BadInput(memory_plan.refusal(result["reason"], result["nearest"]))
    return 0


def sync_groups(cfg, gpus_per_node: int) -> list[dict]:
    """The groups the run's weight sync forms (weight_sync.topology), on the placement the plan
    assumes; empty when its transport cannot carry the layout (the plan says why)."""
    from agentgym_mega import weight_sync

    layout = weight_sync.planned_layout(cfg.parallel.world_size, cfg.parallel.pp, cfg.rollout.num_engines,
                                        cfg.rollout.engine_tp, cfg.cluster.placement == "colocated", gpus_per_node)
    try:
        transport = weight_sync.choose_transport(cfg.weight_sync.transport, layout, cuda=True)
    except weight_sync.SyncError:
        return []
    return [g.as_dict() for g in weight_sync.sync_groups(transport, layout, cuda=True)]


def stop_lead(cfg, hf: dict, args, gpu_mem_gib: float) -> dict:
    """The plan's "stop_lead" block: the checkpoint's save, the timeout and one step's estimate,
    with the lead (--stop-lead-s, else AGM_STOP_LEAD_S) and its warning where one is given."""
    from agentgym_mega import checkpoint_timing as ct
    from agentgym_mega.memory_reserves import GIB

    figures = ct.stop_lead(cfg, hf, args.gpus_per_node, gpu_mem_gib * GIB / 1e9, args.checkpoint_write_gbps)
    lead_s = args.stop_lead_s or ct.stop_lead_s()
    return figures.as_dict() | {"lead_s": lead_s, "warning": lead_s and ct.lead_warning(lead_s, figures)}
