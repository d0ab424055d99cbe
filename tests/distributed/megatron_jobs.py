"""Work run on spawned gloo ranks by test_megatron_models.py. Each job runs several checks so a
layout costs one launch; it returns plain tensors and numbers, and the tests judge them."""

from __future__ import annotations

import os
import signal
import sys

import torch

from agentgym_mega import platform
from agentgym_mega.config import validate
from agentgym_mega.models.actor import MegatronActor
from agentgym_mega.models.critic import MegatronCritic
from agentgym_mega.models.weights import unwrap

SEQ = 24
TRAIN_STEPS = 4
SAVE_AT = 2


def make_config(tp: int, pp: int, world: int, lr: float = 3e-3, recompute: str = "none"):
    return validate({
        "parallel": {"world_size": world, "tp": tp, "pp": pp, "recompute": recompute},
        "trainer": {"lr": lr, "total_steps": TRAIN_STEPS, "batch_size": 4, "mini_batch_size": 4,
                    "grad_clip": 0.5, "lr_schedule": "cosine", "min_lr": 1e-4},
    })


def tokens(vocab: int, batch: int = 4, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def sft_loss(logp, entropy, mb):
    """A fixed loss to minimise: mean negative log-likelihood of the batch's tokens, as the
    (total, count, metric totals) the model shards take."""
    count = torch.tensor(logp[:, 1:].numel())
    return -logp[:, 1:].sum(), count, {"entropy": entropy[:, 1:].sum()}


def some_positions(ids: torch.Tensor) -> torch.Tensor:
    """Where a loss might look: every third token from the second, and the last."""
    at = torch.zeros_like(ids)
    at[:, 1::3] = 1
    at[:, -1] = 1
    return at


def train(actor, steps: range, ids) -> list[dict]:
    return [actor.update({"input_ids": ids}, sft_loss, micro_batch_size=2) for _ in steps]


def parity_job(tp: int, pp: int, world: int, models: dict, work: str, load_from: str | None) -> dict:
    """Per architecture: logits, log-probs and entropy of a fixed batch (also computed at some
    positions only, where the policy model's LM head runs on those rows alone); the exported HF tensors;
    with ``load_from``, the logits after loading that checkpoint (saved at another layout)."""
    platform.init_distributed(tp=tp, pp=pp, seed=0)
    cfg = make_config(tp, pp, world)
    out = {}
    for arch, hf_dir in models.items():
        ref = MegatronActor(hf_dir, cfg, trainable=False)
        ids = tokens(ref.hf_config.vocab_size)
        res = {"logits": ref.full_logits(ids, 2), **ref.logprobs(ids, micro_batch_size=2),
               "logprobs_t2": ref.logprobs(ids, temperature=2.0)["logprobs"],
               "at_positions": ref.logprobs(ids, micro_batch_size=2, positions=some_positions(ids)),
               "exported": {k: v.clone() for k, v in ref.export_hf()},
               "exported_stage": {k: v.clone() for k, v in ref.export_hf(to="stage")},
               "exported_every": {k: v.clone() for k, v in ref.export_hf(to="every")}}
        res["saved_hf"] = ref.save_hf(os.path.join(work, f"{arch}-exported-tp{tp}pp{pp}"))
        if load_from:
            actor = MegatronActor(hf_dir, cfg)
            actor.load_checkpoint(os.path.join(load_from, arch))
            res["loaded_logits"] = actor.full_logits(ids, 2)
            res["update"] = actor.update({"input_ids": ids}, sft_loss, micro_batch_size=2)
        out[arch] = res
    return out


def training_job(models: dict, work: str) -> dict:
    """TP=2: an uninterrupted run of TRAIN_STEPS steps saving at SAVE_AT, then a fresh actor
    resumed from that checkpoint running the remaining steps; and the critic's values and update."""
    platform.init_distributed(tp=2, pp=1, seed=0)
    cfg = make_config(2, 1, 2)
    out = {}
    for arch, hf_dir in models.items():
        root = os.path.join(work, arch)
        actor = MegatronActor(hf_dir, cfg)
        ids = tokens(actor.hf_config.vocab_size, seed=1)
        first = train(actor, range(SAVE_AT), ids)
        actor.save_checkpoint(root, SAVE_AT, {"horizon_stage": 1, "data_position": 17})
        rest = train(actor, range(SAVE_AT, TRAIN_STEPS), ids)
        final = {k: v.clone() for k, v in actor.export_hf()}
        del actor
        resumed = MegatronActor(hf_dir, cfg)
        trainer_state = resumed.load_checkpoint(root)
        saved_logits = resumed.full_logits(tokens(resumed.hf_config.vocab_size), 2)
        resumed_rest = train(resumed, range(SAVE_AT, TRAIN_STEPS), ids)
        resumed_final = {k: v.clone() for k, v in resumed.export_hf()}
        del resumed
        recomputed = MegatronActor(hf_dir, make_config(2, 1, 2, recompute="full"))
        recompute_history = train(recomputed, range(SAVE_AT), ids)
        del recomputed
        critic = MegatronCritic(hf_dir, cfg)
        before = critic.values(ids)
        returns = torch.linspace(-1, 1, ids.shape[1]).expand_as(ids)
        critic_metrics = [critic.update({"input_ids": ids, "returns": returns}, critic_objective, 2)
                          for _ in range(3)]
        out[arch] = {"history": first + rest, "resumed_history": resumed_rest, "final": final,
                     "resumed_final": resumed_final, "trainer_state": trainer_state,
                     "saved_logits": saved_logits, "values_before": before, "values_after": critic.values(ids),
                     "critic_losses": [m["loss"] for m in critic_metrics],
                     "recompute_history": recompute_history}
    return out


def data_parallel_job(world: int, hf_dir: str, aggs: list[str]) -> dict:
    """At DP = ``world`` (TP = PP = 1): log-probs, entropy and critic values of a fixed batch of
    8; then, per loss aggregation, one PPO update (KL and entropy terms on) from the HF weights,
    in micro-batches of 2, with the weights before and after."""
    from agentgym_mega.algorithms import actor_loss
    from agentgym_mega.config import to_dict

    platform.init_distributed(tp=1, pp=1, seed=0)
    cfg = make_config(1, 1, world)
    ref = MegatronActor(hf_dir, cfg, trainable=False)
    ids = tokens(ref.hf_config.vocab_size, batch=8, seed=2)
    out = ref.logprobs(ids, micro_batch_size=2)
    del ref
    critic = MegatronCritic(hf_dir, cfg)
    out["values"] = critic.values(ids, micro_batch_size=2)
    del critic
    gen = torch.Generator().manual_seed(3)
    mask = torch.zeros(ids.shape)
    mask[:4, 1:] = torch.rand(4, SEQ - 1, generator=gen) < 0.2  # the first DP half: sparse
    mask[4:, 2:] = 1.0
    mask[5] = 0.0  # a sequence without trained tokens
    batch = {"input_ids": ids, "loss_mask": mask,
             "old_logprobs": out["logprobs"] + 0.3 * torch.randn(ids.shape, generator=gen),
             "ref_logprobs": out["logprobs"] + 0.1 * torch.randn(ids.shape, generator=gen),
             "advantages": torch.randn(ids.shape, generator=gen)}
    for agg in aggs:
        data = to_dict(cfg)
        data["algorithm"].update(loss_agg=agg, kl_coef=0.1, kl_type="k3", entropy_coef=0.01)
        agg_cfg = validate(data)
        actor = MegatronActor(hf_dir, agg_cfg)
        before = {k: v.clone() for k, v in actor.export_hf()}
        metrics = actor.update(batch, lambda logp, ent, mb: actor_loss(logp, ent, mb, agg_cfg.algorithm),
                               micro_batch_size=2)
        out[agg] = {"metrics": metrics, "before": before, "after": {k: v.clone() for k, v in actor.export_hf()}}
        del actor
    return out


def critic_objective(values, mb):
    return ((values - mb["returns"]) ** 2).sum(), torch.tensor(values.numel()), {}


def fit_values(critic, steps: range, ids) -> list[dict]:
    returns = torch.linspace(-1, 1, ids.shape[1]).expand_as(ids)
    return [critic.update({"input_ids": ids, "returns": returns}, critic_objective, micro_batch_size=2) for _ in steps]


def head_outputs(critic, ids) -> torch.Tensor:
    """``[B, T]`` raw value-head outputs, before the critic aligns them to tokens."""
    def head(out, mb):
        return out.sum() * 0, {"out": out.squeeze(-1).float()}

    return critic.infer({"input_ids": ids}, head, ("out",), micro_batch_size=2)["out"]


def critic_checkpoint_job(tp: int, pp: int, models: dict, work: str, load_from: str | None) -> dict:
    """Per architecture, a critic at (tp, pp): an uninterrupted run of TRAIN_STEPS updates that
    saves at SAVE_AT, then a fresh critic resumed from that checkpoint running the remaining
    updates. Returns the step metrics, the values of a fixed batch right after the save and right
    after the load, the value head's raw outputs at the end, the exported HF tensors of both runs,
    the save_hf directory and how the head appears in the sharded state dict; with ``load_from``,
    the values after loading that root's checkpoint (saved at another layout: model only)."""
    platform.init_distributed(tp=tp, pp=pp, seed=0)
    cfg = make_config(tp, pp, tp * pp)
    out = {}
    for arch, hf_dir in models.items():
        root = os.path.join(work, arch)
        critic = MegatronCritic(hf_dir, cfg)
        ids, probe = tokens(critic.hf_config.vocab_size, seed=1), tokens(critic.hf_config.vocab_size)
        history = fit_values(critic, range(SAVE_AT), ids)
        critic.save_checkpoint(root, SAVE_AT, {"data_position": 5})
        saved_values = critic.values(probe, 2)
        history += fit_values(critic, range(SAVE_AT, TRAIN_STEPS), ids)
        head = {k: (v.key, v.global_shape, v.replica_id, v.allow_shape_mismatch)
                for k, v in unwrap(critic.model).sharded_state_dict().items() if k.startswith("output_layer.")}
        res = {"history": history, "saved_values": saved_values, "head_sharded": head,
               "final_head_out": head_outputs(critic, probe),
               "final": {k: v.clone() for k, v in critic.export_hf()},
               "saved_hf": critic.save_hf(os.path.join(work, f"{arch}-critic-hf"))}
        del critic
        resumed = MegatronCritic(hf_dir, cfg)
        res["trainer_state"] = resumed.load_checkpoint(root)
        res["loaded_values"] = resumed.values(probe, 2)
        res["resumed_history"] = fit_values(resumed, range(SAVE_AT, TRAIN_STEPS), ids)
        res["resumed_final"] = {k: v.clone() for k, v in resumed.export_hf()}
        del resumed
        if load_from:
            other = MegatronCritic(hf_dir, cfg)
            other.load_checkpoint(os.path.join(load_from, arch))
            res["values_from_other_layout"] = other.values(probe, 2)
            del other
        out[arch] = res
    return out


def kill_during_save(hf_dir: str, root: str) -> None:
    """One rank builds an actor and starts saving the next checkpoint into ``root``; its process
    group (it and dist_checkpointing's writer helper) is SIGKILLed after dist_checkpointing wrote
    the files and before the checkpoint is committed. Run it with ``start_new_session=True``."""
    from megatron.core import dist_checkpointing

    real_save = dist_checkpointing.save

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    dist_checkpointing.save = save_then_die
    # One rank hosts its own rendezvous: port 0 lets the OS pick it as the store binds.
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    platform.init_distributed(tp=1, pp=1, seed=0)
    actor = MegatronActor(hf_dir, make_config(1, 1, 1))
    actor.save_checkpoint(root, SAVE_AT + 1, {})


if __name__ == "__main__":
    kill_during_save(sys.argv[1], sys.argv[2])


LENGTHS = [24, 10, 17, 5, 24, 12, 8, 20]  # real lengths of a ragged batch of 8, right-padded to SEQ


def masked_nll(logp, entropy, mb):
    """Mean NLL of the real tokens after the first (the model shards' (total, count, metrics) form)."""
    mask = mb["loss_mask"]
    return -(logp * mask).sum(), mask.sum(), {"entropy": (entropy * mask).sum()}


def micro_batch_job(tp: int, pp: int, world: int, hf_dir: str) -> dict:
    """One update of a ragged batch of 8 from the HF weights, per way of cutting it: one
    micro-batch, micro-batches of 4 and of 2 sequences, and token-budget bins; each with the
    log-probs before and after (real tokens only), its metrics, and what megatron's schedule was
    given (function and number of micro-batches)."""
    from agentgym_mega.models import shard  # the schedule is recorded where the shard looks it up

    platform.init_distributed(tp=tp, pp=pp, seed=0)
    seen = []
    original = shard.get_forward_backward_func

    def recording():
        schedule = original()

        def run(**kwargs):
            seen.append((schedule.__name__, kwargs["num_microbatches"]))
            return schedule(**kwargs)
        return run

    shard.get_forward_backward_func = recording
    ids = tokens(512, batch=len(LENGTHS), seed=4)
    attention = (torch.arange(SEQ) < torch.tensor(LENGTHS)[:, None]).long()
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": attention.float() * (torch.arange(SEQ) > 0)}
    ways = {"one": (None, None), "4_per_micro": (4, None), "2_per_micro": (2, None), "tokens_48": (None, 48)}
    out = {}
    try:
        for name, (micro, budget) in ways.items():
            data = {"parallel": {"world_size": world, "tp": tp, "pp": pp},
                    "rollout": {"max_model_len": 32, "max_tokens_per_turn": 8},
                    "trainer": {"lr": 3e-3, "grad_clip": 0.5, "batch_size": 4, "mini_batch_size": 4,
                                "micro_batch_size": micro, "max_tokens_per_gpu": budget}}
            actor = MegatronActor(hf_dir, validate(data))
            seen.clear()
            before = actor.logprobs(ids, attention_mask=attention)["logprobs"]
            metrics = actor.update(batch, masked_nll)
            schedules = list(seen)
            after = actor.logprobs(ids, attention_mask=attention)["logprobs"]
            out[name] = {"before": before * attention, "after": after * attention, "metrics": metrics,
                         "schedules": schedules}
            del actor
    finally:
        shard.get_forward_backward_func = original
    return out


def _freed(tensors) -> bool:
    return all(t.untyped_storage().nbytes() == 0 for t in tensors)


def offload_job(hf_dir: str) -> dict:
    """TP=2: an actor taking two updates with its memory released and restored in between (as
    the loop does: optimizer and gradients first, parameters after the weight sync), against one
    taking them without; what the release freed; the reference policy's log-probs across a
    release; and the critic's update across one."""
    platform.init_distributed(tp=2, pp=1, seed=0)
    cfg = make_config(2, 1, 2)
    ids = tokens(512, batch=4, seed=5)
    batch = {"input_ids": ids}
    plain = MegatronActor(hf_dir, cfg)
    plain_metrics = [plain.update(batch, sft_loss) for _ in range(2)]
    plain_after = {k: v.clone() for k, v in plain.export_hf()}
    del plain

    actor = MegatronActor(hf_dir, cfg)
    metrics = [actor.update(batch, sft_loss)]
    inner = actor.optimizer.chained_optimizers[0].optimizer
    moments = [v for state in inner.state.values() for v in state.values() if v.dim() > 0]
    grads = [b.grad_data for b in actor.model.buffers]
    params = list(actor.model.parameters())
    actor.release_memory(params=False)
    freed = {"moments": _freed(moments), "grads": _freed(grads), "params_kept": not _freed(params)}
    exported_while_released = {k: v.clone() for k, v in actor.export_hf()}  # a weight sync reads these
    actor.release_memory(params=True)
    freed["params"] = _freed(params)
    actor.restore_memory()
    freed["restored"] = not any(_freed(t) for t in (moments, grads, params))
    metrics.append(actor.update(batch, sft_loss))
    after = {k: v.clone() for k, v in actor.export_hf()}
    del actor

    ref = MegatronActor(hf_dir, cfg, trainable=False)
    ref_before = ref.logprobs(ids)["logprobs"]
    ref.release_memory()
    freed["ref_params"] = _freed(list(ref.model.parameters()))
    ref.restore_memory()
    ref_after = ref.logprobs(ids)["logprobs"]
    del ref

    critic_losses = {}
    for released in (False, True):
        critic = MegatronCritic(hf_dir, cfg)
        losses = [fit_values(critic, range(1), ids)[0]["loss"]]
        if released:
            critic.release_memory()
            critic.restore_memory()
        losses.append(fit_values(critic, range(1), ids)[0]["loss"])
        critic_losses[released] = losses
        del critic
    return {"plain_metrics": plain_metrics, "plain_after": plain_after, "metrics": metrics, "after": after,
            "exported_while_released": exported_while_released, "freed": freed,
            "ref_before": ref_before, "ref_after": ref_after, "critic_losses": critic_losses}


def attention_job(hf_dir: str) -> dict:
    """The built model's core attention class, and torch's fused attention (SdpaAttention)
    against megatron's DotProductAttention on the same query groups, in the forward and backward
    pass; once more with an explicit mask, which SdpaAttention hands to megatron's path."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from agentgym_mega.models import gpt

    platform.init_distributed(tp=1, pp=1, seed=0)
    hf_config = gpt.load_hf_config(hf_dir)
    model = gpt.build_gpt(hf_config, gpt.ModelSplit(), torch.float32)
    config = gpt.transformer_config(hf_config, gpt.ModelSplit(), torch.float32)
    heads, groups, dim = config.num_attention_heads, config.num_query_groups, config.kv_channels
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(9, 3, n, dim, generator=g) for n in (heads, groups, groups)]
    mask = torch.ones(9, 9, dtype=torch.bool).triu(1).expand(3, 1, 9, 9)  # True: masked out (causal)
    out = {"core_attention": type(model.decoder.layers[0].self_attention.core_attention).__name__}
    for name, cls in (("sdpa", gpt.sdpa_attention()), ("megatron", DotProductAttention)):
        module = cls(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        for masked in (False, True):
            inputs = [t.clone().requires_grad_() for t in qkv]
            context = module(*inputs, mask if masked else None)
            context.square().sum().backward()
            out[f"{name}_{'mask' if masked else 'causal'}"] = [context.detach()] + [t.grad for t in inputs]
    return out
