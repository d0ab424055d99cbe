"""An estimate, not a measurement: seconds per phase of a training step for a recipe scaled to
1-16 nodes, from the planner's memory and FLOP counts and stated hardware rates.

A recipe (configs/recipes/) is scaled by data parallelism: its TP, PP, engine TP, recompute and
micro-batch stay, `parallel.world_size` and `rollout.num_engines` grow with the nodes, the batch
stays (strong scaling, as a run's batch is a hyperparameter). A node count where that layout
cannot be built, does not fit (:func:`agentgym_mega.memory_plan.plan_layout`) or does not split
the batch (the config's own checks) is reported with the reason.

Per step, for S = batch_size x n_per_task episodes of L tokens, G of them generated, over T turns:

* rollout: each engine runs its S / engines episodes, at most as many at once as its KV cache
  holds L-token sequences (waves). A decode step reads the engine GPU's weights and the running
  sequences' KV cache (average context L/2) from HBM at `hbm_efficiency` of its bandwidth, or is
  compute bound if that is slower, plus two TP all-reduces per layer at engine TP > 1; G decode
  steps per wave. Prefill of the other L - G tokens at `mfu`. Env steps: T per wave, each
  `env_step_s` (a lock-step turn waits for its slowest).
* log-probs: a forward pass per role (actor; reference with a KL term; critic under GAE) over
  S x L tokens at `mfu` of every trainer GPU's peak, stretched by the pipeline bubble
  (1 + (pp - 1) / micro-batches per rank).
* train: forward + backward (3 forwards; 4 with full recompute) per trained role and PPO epoch,
  the bubble per mini-batch, plus per optimizer step the distributed optimizer's reduce-scatter
  of fp32 gradients and all-gather of bf16 parameters over the DP group ((dp - 1) / dp x 6 bytes
  per parameter of the rank), on NVLink when the DP group is inside a node, else the network.
* sync: the weights (engine dtype) to the engines: CUDA IPC for colocated engines on any number
  of nodes (every rank exports the whole model: each stage's TP gather over NVLink, the other
  stages' share broadcast over the PP group, on the network once the run spans nodes, then a
  device copy); the collective for engines on GPUs of their own (each PP stage's share over one
  network link, the broadcast sending each byte once, after its TP gather).
* offload (colocated, cluster.offload on): each trainer role's parameters and optimizer state
  to host memory and back over PCIe; the engines sleep at level 2 during steps (the sync rewrites
  their weights), so their weights are not copied.

Not modelled: env servers' CPU limits, stragglers, load imbalance between episodes, the engines'
load after the bytes arrive, start-up, checkpoints and evaluation.
"""

from __future__ import annotations

import dataclasses
import math

from agentgym_mega import memory_formulas as mf
from agentgym_mega import memory_plan as mp
from agentgym_mega.cluster import roles as run_roles
from agentgym_mega.config import Config, ConfigError, apply_overrides, to_dict, validate
from agentgym_mega.errors import BadInput
from agentgym_mega.scaling.assumptions import Hardware, Workload

RECIPES = ("configs/recipes/textcraft_qwen2.5-7b.yaml", "configs/recipes/textcraft_qwen2.5-14b.yaml",
           "configs/recipes/textcraft_qwen2.5-32b.yaml", "configs/recipes/textcraft_llama-3.1-70b.yaml")
PHASES = ("rollout", "logprob", "train", "sync", "offload")


def scaled(cfg: Config, nodes: int, gpus_per_node: int) -> list[str]:
    """Overrides that give the recipe `nodes` nodes: DP grows, engines follow the trainer GPUs."""
    base = mp.Layout.of(cfg, gpus_per_node, 80.0, None)
    factor = nodes / base.nodes_used
    world, engines = base.world_size * factor, base.num_engines * factor
    if world != int(world) or engines != int(engines) or engines < 1:
        raise mf.LayoutError(f"{base.world_size} trainer GPUs and {base.num_engines} engines on "
                             f"{base.nodes_used} node(s) do not scale to {nodes}")
    return [f"parallel.world_size={int(world)}", f"rollout.num_engines={int(engines)}", "parallel.dp=null"]


def _bubble(pp: int, tokens_per_rank: float, micro_tokens: int) -> float:
    return 1 + (pp - 1) / max(1, math.ceil(tokens_per_rank / micro_tokens))


def estimate(cfg: Config, hf: dict, nodes: int, hw: Hardware, work: Workload, gpus_per_node: int = 8,
             gpu_mem_gb: float = 80.0) -> dict:
    """One row: the layout at `nodes` and its seconds per phase, or `error` naming why it has none."""
    try:
        overrides = scaled(cfg, nodes, gpus_per_node)
        cfg = validate(apply_overrides(to_dict(cfg), overrides))
        a = mf.Arch.of(hf)
        lay = mp.Layout.of(cfg, gpus_per_node, round(gpu_mem_gb * mf.GB), nodes)
        plan = mp.plan_layout(a, lay)
    except (mf.LayoutError, ConfigError) as exc:
        return {"nodes": nodes, "error": str(exc).replace("invalid config:\n  ", "").splitlines()[0]}
    if not plan["fits"]:
        return {"nodes": nodes, "error": f"does not fit: {plan['reason']}"}
    L, G = work.episode_tokens, work.generated_tokens
    if L > cfg.rollout.max_model_len or G >= L:
        raise BadInput(f"episode of {L} tokens with {G} generated: needs generated < episode <= "
                       f"rollout.max_model_len={cfg.rollout.max_model_len}")
    turns = work.turns or max(cfg.horizon.caps)
    S = cfg.trainer.batch_size * cfg.rollout.n_per_task
    flop_rate = hw.peak_tflops * 1e12 * hw.mfu
    fwd = mf.forward_flops_per_token(a, L / 2)
    engine = plan["engine"]
    roles = run_roles(cfg)

    # rollout
    etp, per_engine = lay.engine_tp, math.ceil(S / lay.num_engines)
    running = min(per_engine, engine["kv_tokens"] // L)
    waves = math.ceil(per_engine / running)
    read = engine["weights"] + running * (L / 2) * engine["kv_bytes_per_token"]
    decode_step = (max(read / (hw.hbm_tbps * 1e12 * hw.hbm_efficiency), running * fwd / etp / flop_rate)
                   + (2 * a.layers * hw.allreduce_us * 1e-6 if etp > 1 else 0))
    prefill = per_engine * (L - G) * fwd / etp / flop_rate
    rollout = {"decode": waves * G * decode_step, "prefill": prefill, "env": waves * turns * work.env_step_s}

    # log-probs and train
    tokens = S * L
    micro_tokens = lay.tokens()[0]
    per_rank = tokens / lay.dp
    gpus = lay.world_size
    logprob = len(roles) * tokens * fwd / (gpus * flop_rate) * _bubble(lay.pp, per_rank, micro_tokens)
    trained = [r for r in roles if r != "ref"]
    passes = 3 + (lay.recompute == "full")
    minis = cfg.trainer.batch_size // cfg.trainer.mini_batch_size
    compute = (len(trained) * cfg.trainer.ppo_epochs * passes * tokens * fwd / (gpus * flop_rate)
               * _bubble(lay.pp, per_rank / minis, micro_tokens))
    rank_params = mf.stage_params(a, lay.tp, lay.pp, 0)
    dp_inside_node = lay.tp * lay.dp <= gpus_per_node
    dp_link = (hw.nvlink_gbps if dp_inside_node else hw.network_gbps) * 1e9
    dp_step = (lay.dp - 1) / lay.dp * rank_params * 6 / dp_link
    optimizer_steps = len(trained) * cfg.trainer.ppo_epochs * minis
    train = {"compute": compute, "dp_comm": optimizer_steps * dp_step}

    # weight sync
    weights = mf.total_params(a) * lay.engine_dtype_bytes
    transport = lay.sync_transport()
    gather = weights / lay.pp * (lay.tp - 1) / lay.tp / (hw.nvlink_gbps * 1e9)
    if transport == "cuda_ipc":
        pp_link = (hw.nvlink_gbps if lay.world_size <= gpus_per_node else hw.network_gbps) * 1e9
        sync = (gather * lay.pp + weights * (lay.pp - 1) / lay.pp / pp_link
                + weights / (hw.hbm_tbps * 1e12 * hw.hbm_efficiency))
    else:
        sync = gather + weights / lay.pp / (hw.network_gbps * 1e9)

    # offload
    offload = 0.0
    if lay.offload:
        gpu0 = plan["gpus"][0]["roles"]
        kept = sum(r["params"] + r["optimizer"] for name, r in gpu0.items() if name != "engine")
        offload = 2 * kept / (hw.pcie_gbps * 1e9)

    seconds = {"rollout": sum(rollout.values()), "logprob": logprob, "train": sum(train.values()), "sync": sync,
               "offload": offload}
    step = sum(seconds.values())
    return {"nodes": nodes, "gpus": lay.gpus_needed, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp,
            "engine_tp": etp, "engines": lay.num_engines, "transport": transport,
            "peak_gb": plan["peak_bytes"] / mf.GB, "tokens_per_step": tokens, "waves": waves,
            "seconds": seconds, "detail": {"rollout": rollout, "train": train}, "step_s": step,
            "tokens_per_s": tokens / step}


def project(recipes: list[tuple[str, object, dict]], nodes: list[int], hw: Hardware, work: Workload,
            gpus_per_node: int = 8, gpu_mem_gb: float = 80.0) -> dict:
    """Rows for every (recipe, node count); efficiency against each recipe's fewest nodes that fit."""
    rows = []
    for name, cfg, hf in recipes:
        base = None
        for n in nodes:
            row = {"recipe": name, "model_params": mf.total_params(mf.Arch.of(hf))}
            row |= estimate(cfg, hf, n, hw, work, gpus_per_node, gpu_mem_gb)
            if "error" not in row:
                base = base or row
                row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
                row["efficiency"] = row["speedup"] / (row["gpus"] / base["gpus"])
            rows.append(row)
    return {"estimate": True, "hardware": dataclasses.asdict(hw), "workload": dataclasses.asdict(work),
            "gpus_per_node": gpus_per_node, "gpu_mem_gb": gpu_mem_gb, "rows": rows}


def table(result: dict) -> str:
    """The projection as Markdown, headed as the estimate it is."""
    hw, work = result["hardware"], result["workload"]
    lines = [
        "ESTIMATE, not a measurement (agentgym-mega scaling --project): "
        f"{result['gpus_per_node']} GPUs of {result['gpu_mem_gb']:g} GB per node, {hw['peak_tflops']:g} TFLOP/s "
        f"bf16 at MFU {hw['mfu']:g}, HBM {hw['hbm_tbps']:g} TB/s at {hw['hbm_efficiency']:g}, NVLink "
        f"{hw['nvlink_gbps']:g} GB/s, network {hw['network_gbps']:g} GB/s and PCIe {hw['pcie_gbps']:g} GB/s per GPU; "
        f"episodes of {work['episode_tokens']} tokens ({work['generated_tokens']} generated), "
        + (f"{work['turns']} turns" if work["turns"] else "as many turns as each recipe's largest cap")
        + f", each {work['env_step_s']:g} s of env latency.",
        "",
        "| recipe | nodes | TP/PP/DP | engines | sync | rollout s | log-probs s | train s | sync s | offload s "
        "| step s | tokens/s | speedup | efficiency |",
        "|" + "---|" * 14,
    ]
    for r in result["rows"]:
        name = r["recipe"].rsplit("/", 1)[-1].removesuffix(".yaml")
        if "error" in r:
            lines.append(f"| {name} | {r['nodes']} | {r['error']} |" + " |" * 11)
            continue
        s = r["seconds"]
        lines.append(
            f"| {name} | {r['nodes']} | {r['tp']}/{r['pp']}/{r['dp']} | {r['engines']} x tp{r['engine_tp']} | "
            f"{r['transport']} | {s['rollout']:.1f} | {s['logprob']:.1f} | {s['train']:.1f} | {s['sync']:.2f} | "
            f"{s['offload']:.1f} | {r['step_s']:.1f} | {r['tokens_per_s']:,.0f} | {r['speedup']:.2f} | "
            f"{r['efficiency']:.2f} |")
    return "\n".join(lines)
