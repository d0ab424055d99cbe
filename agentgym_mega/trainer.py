"""`agentgym-mega train`: the RL loop, readable top to bottom.

rollout -> old/ref log-probs -> values -> advantages -> updates -> weight sync -> eval -> log -> checkpoint

With trainer.off_policy_steps=1 the next step's rollout runs on the engines (their weights one
version behind) while this step trains; it is waited for before the weight sync, and a
checkpoint keeps it, so a resumed run trains on the same batch.

With cluster.offload the trainer's device memory is released while the engines hold theirs:
engines sleep -> trainer restored -> log-probs, updates -> trainer released (the actor keeps its
parameters) -> engine weights woken -> weight sync -> actor parameters released -> KV cache woken.
The engines sleep discarding their weights (vLLM's level 2): the sync rewrites every one of them,
so copying them to host memory and back would be thrown away. An engine the sync left without a
complete version refuses to generate; Stack.sync_engines re-sends, then drops it or stops the run.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from agentgym_mega import algorithms, checkpoint_timing, files
from agentgym_mega.errors import BadInput
from agentgym_mega.evaluation import Evaluator
from agentgym_mega.memory_plan import read_architecture
from agentgym_mega.metrics import Timer, episode_metrics, plot_rewards, sync_metrics
from agentgym_mega.models import checkpoint
from agentgym_mega.rollout.batch import TrajectoryBatch
from agentgym_mega.rollout.dynamic_sampling import collect_batch
from agentgym_mega.rollout.tasks import TaskSampler, select_tasks
from agentgym_mega.run_record import RunRecord
from agentgym_mega.stack import Stack

if TYPE_CHECKING:
    from agentgym_mega.config import Config

# The exit code of `agentgym-mega train` stopped by SIGUSR1 or SIGTERM after a checkpoint (sysexits'
# EX_TEMPFAIL: the same command with --resume goes on); slurm/train_scalinginter.sh requeues on it.
STOPPED_EXIT_CODE = 75
RESUME_MODES = ("latest", "auto")


class Stopped(Exception):
    """Training stopped early on request (SIGUSR1 or SIGTERM to the CLI), after checkpointing `step`."""

    def __init__(self, step: int):
        super().__init__(f"stopped on request after step {step}, which is checkpointed")
        self.step = step


def _update(stack: Stack, batch, cfg: Config) -> dict:
    """PPO epochs over mini-batches of whole task groups; one optimizer step per mini-batch.
    Metrics are means over the step's updates; with several epochs, each loss also as its mean
    over the first and over the last pass (`*/loss_first_epoch`, `*/loss_last_epoch`: the same
    data, so their gap is how much the step fitted it)."""
    per_mini = cfg.trainer.mini_batch_size * cfg.rollout.n_per_task
    epochs: list[dict[str, list[float]]] = []  # per epoch, each metric's value at each update
    for _ in range(cfg.trainer.ppo_epochs):
        epoch: dict[str, list[float]] = {}
        epochs.append(epoch)
        for mini in batch.split(len(batch) // per_mini):
            out = {f"actor/{k}": v
                   for k, v in stack.actor.update(mini.for_policy_update(), cfg.rollout.temperature).items()}
            if stack.critic is not None:
                out |= {f"critic/{k}": v for k, v in stack.critic.update(mini.for_value_update()).items()}
            for key, value in out.items():
                epoch.setdefault(key, []).append(value)
    means = {key: statistics.fmean(v for e in epochs for v in e[key]) for key in epochs[0]}
    if len(epochs) > 1:
        for key in [k for k in means if k.endswith("/loss")]:
            means[f"{key}_first_epoch"] = statistics.fmean(epochs[0][key])
            means[f"{key}_last_epoch"] = statistics.fmean(epochs[-1][key])
    return means


def _save(stack: Stack, cfg: Config, step: int, sampler: TaskSampler, ahead: tuple | None) -> None:
    """The trainer roles' checkpoints of `step`; first, with one-step off-policy, the rollout
    collected `ahead` for the next step (`rollout/iter_N/batch.pt`), so every actor checkpoint
    has it."""
    state = {"sampler_position": sampler.position}
    root = _checkpoint_root(cfg)
    if ahead is not None:
        batch, metrics = ahead
        final = os.path.join(root, "rollout", f"iter_{step:07d}")
        tmp = files.atomic_dir(final)
        torch.save({"batch": batch.state(), "metrics": metrics}, os.path.join(tmp, "batch.pt"))
        files.commit_dir(tmp, final)
    saved = [g for g in (stack.actor, stack.critic) if g is not None]  # the reference has nothing to save
    stack.trainers_restore(saved)
    stack.actor.save_checkpoint(os.path.join(root, "actor"), step, state)
    if stack.critic is not None:
        stack.critic.save_checkpoint(os.path.join(root, "critic"), step, state)
    stack.trainers_release()


def _checkpoint_root(cfg: Config) -> str:
    return os.path.join(cfg.trainer.output_dir, "checkpoints")


def resume_from(cfg: Config, mode: str | None) -> bool:
    """Whether a run continues from a checkpoint: `latest` requires one in trainer.output_dir,
    `auto` takes it when there is one (a first start and a requeued job run the same command)."""
    if mode is None:
        return False
    if mode not in RESUME_MODES:
        raise BadInput(f"--resume {mode!r}: expected one of {', '.join(RESUME_MODES)}")
    found = os.path.isfile(os.path.join(_checkpoint_root(cfg), "actor", checkpoint.LATEST))
    if mode == "latest" and not found:
        raise BadInput(f"--resume: no checkpoint in {_checkpoint_root(cfg)} (trainer.output_dir="
                       f"{cfg.trainer.output_dir}); --resume auto starts fresh when there is none")
    return found


def _resume(stack: Stack, cfg: Config) -> tuple[int, int, tuple | None]:
    """Loads the latest checkpoint and gives the engines its weights (they started from the HF
    ones); returns (next step, sampler position, the rollout collected ahead for the next step
    when the run is one step off-policy and the checkpoint has one)."""
    root = _checkpoint_root(cfg)
    state = stack.actor.load_checkpoint(os.path.join(root, "actor"))
    if stack.critic is not None:
        stack.critic.load_checkpoint(os.path.join(root, "critic"))
    step = state["global_step"]
    stack.trainers_release(actor_params=False)
    stack.engines_wake(("weights",))
    stack.sync_engines(step)
    ahead = os.path.join(root, "rollout", f"iter_{step:07d}", "batch.pt")
    if not (cfg.trainer.off_policy_steps and os.path.isfile(ahead)):
        return step + 1, state["sampler_position"], None  # without it, the next step collects its own
    saved = torch.load(ahead, weights_only=True)
    return step + 1, state["sampler_position"], (TrajectoryBatch.from_state(saved["batch"]), saved["metrics"])


def train(cfg: Config, resume: str | None = None, stop: threading.Event | None = None) -> dict:
    """Runs cfg.trainer.total_steps steps (from the latest checkpoint with `resume`, see
    resume_from); returns the last step's metrics. `stop` set (the CLI: on SIGUSR1 or SIGTERM) ends
    the run after the current step and a checkpoint, raising Stopped."""
    resume = resume_from(cfg, resume)
    stop = stop or threading.Event()
    stopped = None
    lead = _stop_lead(cfg)
    record = RunRecord(cfg, resume)  # first: a W&B setup that cannot log fails before anything starts
    with Stack.start(cfg) as stack:
        start, position, ahead = _resume(stack, cfg) if resume else (1, 0, None)
        stack.trainers_release()  # the engines generate first
        stack.engines_wake()
        sampler = TaskSampler(stack.tasks, cfg.trainer.seed, position)
        nodes = stack.placement.nodes()
        tqdm.write(f"placement: {nodes['all']} node(s): trainer ranks on {nodes['trainer']}, engine workers on "
                   f"{nodes['engines']}, env servers on {nodes['env_servers']}")
        evaluate = _evaluator(stack, cfg, record)
        if evaluate and cfg.eval.at_start and start == 1:
            record.log(0, _evaluated(evaluate, 0))
        metrics: dict = {}
        stack.engines_host_copy_bytes()  # start-up's copies are no step's
        bar = tqdm(range(start, cfg.trainer.total_steps + 1), initial=start - 1, total=cfg.trainer.total_steps,
                   disable=not cfg.logging.progress_bar, desc="train")
        background = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead")
        for step in bar:
            timer = Timer()
            turn_cap = algorithms.turn_cap(step, cfg.horizon)
            with timer("rollout"):
                batch, rollout_metrics = ahead or collect_batch(stack.rollout, sampler, cfg, step, turn_cap)
            record.episodes(step, "train", batch.episodes)
            next_rollout = None
            if cfg.trainer.off_policy_steps and step < cfg.trainer.total_steps:
                next_rollout = background.submit(collect_batch, stack.rollout, sampler, cfg, step + 1,
                                                 algorithms.turn_cap(step + 1, cfg.horizon))
            else:
                _engines_sleep_until_sync(stack)
            stack.trainers_restore()
            _logprobs_and_values(stack, batch, cfg, timer)
            algorithms.compute_advantages(batch, cfg.algorithm)
            train_metrics = _truncate_importance(batch, cfg.algorithm.tis_cap)
            with timer("train"):
                train_metrics |= _update(stack, batch, cfg)
            with timer("rollout_wait"):  # off-policy: what the next rollout took beyond this step's work
                ahead = next_rollout.result() if next_rollout else None
            synced = _sync_weights(stack, step, timer)
            host_copy_bytes = stack.engines_host_copy_bytes()
            tokens = int(batch.attention_mask.sum())
            metrics = (episode_metrics(batch) | train_metrics | timer.metrics() | rollout_metrics
                       | sync_metrics(synced) | {"sync/engines_dropped": stack.dropped_engines,
                                               "sync/host_copy_bytes": host_copy_bytes}
                       | {"horizon/turn_cap": turn_cap, "perf/tokens_per_s": tokens / sum(timer.seconds.values()),
                          "perf/tokens": tokens, "cluster/nodes": nodes["all"]}
                       | _logprob_gap(batch) | _staleness(batch, step) | _ref_kl(batch, cfg))
            if evaluate and cfg.eval.freq and (step % cfg.eval.freq == 0 or step == cfg.trainer.total_steps):
                metrics |= _evaluated(evaluate, step)
            record.log(step, metrics)
            _show(bar, step, metrics, turn_cap)
            if lead and step == start:  # the first step's time, measured: warm-up makes it an upper bound
                _warn(checkpoint_timing.lead_warning(lead[0], lead[1], sum(timer.seconds.values())))
            last = step == cfg.trainer.total_steps
            if last or stop.is_set() or (cfg.trainer.save_freq and step % cfg.trainer.save_freq == 0):
                _save(stack, cfg, step, sampler, ahead)
            if stop.is_set() and not last:
                stopped = step
                tqdm.write(f"stop requested: stopped after step {step}, checkpointed; --resume goes on "
                           f"at step {step + 1}")
                break
        background.shutdown()
        record.close()
        _summarize(evaluate, cfg)
    if stopped is not None:
        raise Stopped(stopped)
    return metrics


def _stop_lead(cfg: Config) -> tuple[float, checkpoint_timing.StopLead] | None:
    """Under Slurm (AGM_STOP_LEAD_S set): the lead and the run's save and step estimates, with
    the warning when they do not fit in it written now, before anything starts."""
    lead_s = checkpoint_timing.stop_lead_s()
    if lead_s is None:
        return None
    figures = checkpoint_timing.stop_lead(cfg, read_architecture(cfg.model)[0])
    _warn(checkpoint_timing.lead_warning(lead_s, figures))
    return lead_s, figures


def _warn(message: str | None) -> None:
    if message:
        tqdm.write(message, file=sys.stderr)


def _logprobs_and_values(stack: Stack, batch: TrajectoryBatch, cfg: Config, timer: Timer) -> None:
    """The batch's old and reference log-probs and the critic's values, each role present."""
    with timer("logprob"):
        batch.old_logprobs = _old_logprobs(stack, batch, cfg)
        if stack.ref is not None:
            batch.ref_logprobs = stack.ref.logprobs(batch.input_ids, cfg.rollout.temperature, batch.attention_mask,
                                                    batch.loss_mask)
    if stack.critic is not None:
        with timer("values"):
            batch.values = stack.critic.values(batch.input_ids, batch.attention_mask)


def _engines_sleep_until_sync(stack: Stack) -> None:
    """The engines free their device memory for the trainer's work, discarding their weights
    (vLLM's level 2): _sync_weights rewrites every one of them before they generate again, so a
    copy to host memory and back would be thrown away."""
    stack.engines_sleep(keep_weights=False)


def _sync_weights(stack: Stack, step: int, timer: Timer):
    """The trained weights into the engines, the trainer making room for the engines' weights and
    then for their KV cache; returns what Stack.sync_engines does."""
    stack.trainers_release(actor_params=False)
    stack.engines_wake(("weights",))
    with timer("sync"):
        synced = stack.sync_engines(step)
    stack.trainers_release()
    stack.engines_wake(("kv_cache",))
    return synced


def _show(bar: tqdm, step: int, metrics: dict, turn_cap: int) -> None:
    bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", turn_cap=turn_cap)
    tqdm.write(f"step {step}: reward {metrics['reward/mean']:.3f} success "
               f"{metrics['reward/success_rate']:.2f} turns {metrics['episode/turns_mean']:.1f} "
               f"turn cap {turn_cap}")


def _summarize(evaluate: Evaluator | None, cfg: Config) -> None:
    """The end of a run: the evaluations side by side and the reward curve."""
    if evaluate and len(evaluate.history) > 1:
        tqdm.write(evaluate.summary())
    if cfg.logging.jsonl and os.path.isfile(os.path.join(cfg.trainer.output_dir, "metrics.jsonl")):  # a step logged
        title = f"{cfg.logging.experiment}: {cfg.env.name} {', '.join(cfg.env.categories or [])}"
        tqdm.write(f"reward curve: {plot_rewards(cfg.trainer.output_dir, title)}")


def _evaluator(stack: Stack, cfg: Config, record: RunRecord) -> Evaluator | None:
    if not (cfg.eval.freq or cfg.eval.at_start):
        return None
    tasks = select_tasks(stack.catalogue, cfg.eval.split, None, cfg.env.categories)[: cfg.eval.limit]
    return Evaluator(stack.rollout, tasks, cfg, keep=record.evaluated)


def _evaluated(evaluate: Evaluator, step: int) -> dict:
    timer = Timer()
    with timer("eval"):
        metrics, table = evaluate(step)
    tqdm.write(f"eval at step {step}:\n{table}")
    return metrics | timer.metrics()


def _ref_kl(batch, cfg: Config) -> dict:
    """Mean per-token KL estimate between the policy that sampled and the reference, on trained
    tokens (0 at step 1, when both are the starting weights); {} without a reference."""
    if batch.ref_logprobs is None:
        return {}
    kl = algorithms.kl_penalty(batch.old_logprobs, batch.ref_logprobs, cfg.algorithm.kl_type)
    return {"actor/ref_kl": float(algorithms.masked_mean(kl, batch.loss_mask))}


def _old_logprobs(stack: Stack, batch, cfg: Config) -> torch.Tensor:
    """The PPO ratio's denominator. One step off-policy without truncated importance weights:
    the engines' own log-probs, the behaviour policy. Otherwise the trainer's, recomputed with
    the weights it starts the step with (on-policy, those that sampled), on trained tokens only
    (every use of them is masked by the loss mask). algorithm.old_logprobs (not auto) picks one."""
    source = cfg.algorithm.old_logprobs
    if source == "engine" or (source == "auto" and cfg.trainer.off_policy_steps and cfg.algorithm.tis_cap is None):
        return batch.rollout_logprobs
    return stack.actor.logprobs(batch.input_ids, cfg.rollout.temperature, batch.attention_mask, batch.loss_mask)


def _truncate_importance(batch, cap: float | None) -> dict:
    """algorithm.tis_cap: each token's advantage times min(p_trainer / p_engine, cap) (a
    non-negative weight, so the clipped PPO term scales by it too); the weights' mean and the
    share of tokens the cap cut."""
    if cap is None:
        return {}
    weights = algorithms.truncated_importance_weights(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, cap)
    batch.advantages = batch.advantages * weights
    return {"actor/tis_weight_mean": float(algorithms.masked_mean(weights, batch.loss_mask)),
            "actor/tis_capped_fraction": float(algorithms.masked_mean((weights >= cap).float(), batch.loss_mask))}


def _logprob_gap(batch) -> dict:
    """Mean |engine - trainer| log-prob on trained tokens: how far rollout and training disagree
    (nothing when the trainer did not recompute them)."""
    mask = batch.loss_mask.bool()
    if batch.old_logprobs is batch.rollout_logprobs:
        return {}
    return {"rollout/logprob_diff": float((batch.rollout_logprobs - batch.old_logprobs)[mask].abs().mean())
            if mask.any() else 0.0}


def _staleness(batch, step: int) -> dict:
    """The weights versions that sampled the trained tokens, and how many versions they are
    behind the trainer's at the step's start (step - 1): 0 on-policy, 1 one step off-policy."""
    versions = batch.weight_versions[batch.loss_mask.bool()]
    if not len(versions):
        return {}
    return {"rollout/weight_version_min": int(versions.min()), "rollout/weight_version_max": int(versions.max()),
            "offpolicy/version_lag": float((step - 1 - versions.float()).mean())}

