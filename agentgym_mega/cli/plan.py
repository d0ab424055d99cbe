"""`agentgym-mega plan`: a config's device memory per GPU, and whether it fits."""

from __future__ import annotations

import json

from agentgym_mega.cli.options import COUNT, bounded, command, overrides_option
from agentgym_mega.errors import BadInput

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
            "placement, against --gpu-mem-gb less 5% headroom (decimal GB: an 80 GB H100 has 85.5).\n"
            "A layout that does not fit, or that megatron or vLLM refuses, exits 2 with the reason and\n"
            "up to 3 nearest layouts that fit, as overrides to paste. The model of memory is in\n"
            "agentgym_mega/memory_formulas.py and docs/clusters.md (\"Planning memory\")."
        ),
    )
    p.add_argument("--config", required=True, help="YAML config (e.g. configs/recipes/*.yaml)")
    p.add_argument("--gpus-per-node", type=COUNT, default=8, help="GPUs per node (default 8)")
    p.add_argument("--gpu-mem-gb", type=bounded(float, 0, "a number of GB > 0"), default=80.0,
                   help="memory of one GPU in decimal GB (default 80)")
    p.add_argument("--nodes", type=COUNT, help="nodes available (default: as many as the layout needs)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (bytes) instead of tables")
    overrides_option(p)


def run(args) -> int:
    from agentgym_mega import memory_plan
    from agentgym_mega.config import load_config

    cfg = load_config(args.config, args.overrides)
    hf, source = memory_plan.read_architecture(cfg.model)
    result = memory_plan.plan(cfg, hf, args.gpus_per_node, args.gpu_mem_gb, args.nodes, source)
    result["sync_groups"] = sync_groups(cfg, args.gpus_per_node)
    print(json.dumps(result, indent=2) if args.json else memory_plan.render(result))
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
