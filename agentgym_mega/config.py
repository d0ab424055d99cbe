"""The one configuration schema: dataclasses validated by pydantic, loaded from YAML.

A run is described by one :class:`Config`. :func:`load_config` reads a YAML file (which may
``include:`` other YAML files, paths relative to itself, later keys winning), applies dotted
command-line overrides (``trainer.total_steps=50``, values parsed as YAML), and validates the
result. Anything wrong raises :class:`ConfigError`, whose message names the key, what was given
and what is allowed; the CLI turns it into exit code 2."""

from __future__ import annotations

import dataclasses
import typing
import warnings
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import ConfigDict, StrictBool, StrictInt, StrictStr, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

import envs
from agentgym_mega.config_files import apply_overrides, read_yaml
from agentgym_mega.errors import ConfigError
from envs import KINDS

# Unknown keys are errors; ints and bools are not coerced into each other (True is no tp size).
# Field docstrings become descriptions, which `agentgym-mega config-reference` renders.
_SCHEMA = ConfigDict(extra="forbid", use_attribute_docstrings=True)
section = dataclass(config=_SCHEMA)
INSTRUCTION_ROLES = ("user", "system")  # where the rollout's ChatTurns puts env.instruction


def _default(factory):
    return dataclasses.field(default_factory=factory)


def _require(ok: bool, key: str, given, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{key}={given!r} is not allowed; allowed: {allowed}")


@section
class ModelConfig:
    """The policy: a Hugging Face directory (converted to megatron-core at start-up)."""

    path: StrictStr = ""
    """Hugging Face model directory of the policy."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """`auto`: bf16 on GPU, fp32 on CPU."""
    critic_path: Optional[StrictStr] = None
    """Where the critic starts from; null: from `path`."""
    architecture: Optional[dict] = None
    """Published config.json facts, for `plan` where `path` is elsewhere; plan and train refuse a mismatch."""


@section
class ParallelConfig:
    """Trainer layout. dp is derived as world_size / (tp * pp) when left null."""

    world_size: StrictInt = 1
    """Trainer ranks: GPUs on clusters, processes on CPU."""
    tp: StrictInt = 1
    """Tensor-parallel size; tp * pp must divide world_size."""
    pp: StrictInt = 1
    """Pipeline-parallel size; tp * pp must divide world_size."""
    dp: Optional[StrictInt] = None
    """Data-parallel size: world_size / (tp * pp), derived when null, checked when given."""
    sequence_parallel: StrictBool = False
    """megatron's sequence parallelism: needs tp > 1 and Transformer Engine (so a GPU)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recompute in the trainer's backward pass."""

    def __post_init__(self):
        for key in ("world_size", "tp", "pp"):
            _require(getattr(self, key) >= 1, f"parallel.{key}", getattr(self, key), "an integer >= 1")
        _require(
            self.world_size % (self.tp * self.pp) == 0,
            "parallel.tp", self.tp,
            f"tp * pp (here {self.tp} * {self.pp}) must divide parallel.world_size={self.world_size}",
        )
        derived = self.world_size // (self.tp * self.pp)
        _require(
            self.dp in (None, derived), "parallel.dp", self.dp,
            f"world_size / (tp * pp) = {derived}, or null to derive it",
        )
        self.dp = derived
        _require(
            not self.sequence_parallel or self.tp > 1, "parallel.sequence_parallel", True,
            "true only when parallel.tp > 1",
        )


@section
class RolloutConfig:
    """Generation: vLLM engines and sampling."""

    engine_tp: StrictInt = 1
    """Tensor-parallel size of each engine."""
    num_engines: StrictInt = 1
    """Engine instances."""
    n_per_task: StrictInt = 4
    """Samples per task (the GRPO/RLOO/GiGPO group); at least 2 for grpo, rloo and gigpo."""
    temperature: float = 1.0
    """Sampling temperature, > 0: greedy decoding has no sampling distribution for PPO's ratio."""
    top_p: float = 1.0
    """Nucleus sampling share, in (0, 1]."""
    seeded: StrictBool = True
    """Seeds each request from (trainer.seed, step, episode, turn), so a resume samples as before."""
    dtype: Optional[Literal["auto", "float32", "bfloat16"]] = None
    """The engines' dtype; null: model.dtype (filled in on load), so the policy that samples is trained."""
    max_tokens_per_turn: StrictInt = 512
    """New tokens per assistant turn."""
    max_model_len: StrictInt = 8192
    """An episode's context limit; a longer episode ends as `truncated`."""
    gpu_memory_utilization: float = 0.6
    """vLLM's share of GPU memory."""
    mode: Literal["lockstep", "async"] = "async"
    """async: each episode generates and steps on its own, engines batching whatever is in flight;
    lockstep: every turn one batched generate, then one batched env step. Same seeds, same tokens."""
    episode_timeout_s: Optional[float] = None
    """Seconds from an episode's first turn after which it ends as `timeout` (not trained on); null: none."""
    env_step_timeout_s: Optional[float] = None
    """Seconds an env step's answer is waited for before its episode ends as `timeout`; null: none."""
    env_group_window_ms: float = 0.0
    """async: env steps ready within this many ms of each other go to their server as one /batch,
    answered when its slowest step is; 0 sends each alone. Pays only for cheap steps on few cores."""
    dynamic_sampling: StrictBool = False
    """DAPO's filter: draw tasks until trainer.batch_size groups have differing scores (else fill)."""
    dynamic_sampling_max_draws: float = 3.0
    """Dynamic sampling draws at most this many times trainer.batch_size groups per step."""

    def __post_init__(self):
        for key in ("engine_tp", "num_engines", "n_per_task", "max_tokens_per_turn"):
            _require(getattr(self, key) >= 1, f"rollout.{key}", getattr(self, key), "an integer >= 1")
        for key in ("episode_timeout_s", "env_step_timeout_s"):
            value = getattr(self, key)
            _require(value is None or value > 0, f"rollout.{key}", value, "a number of seconds > 0, or null")
        _require(self.env_group_window_ms >= 0, "rollout.env_group_window_ms", self.env_group_window_ms,
                 "a number of milliseconds >= 0")
        _require(self.dynamic_sampling_max_draws >= 1, "rollout.dynamic_sampling_max_draws",
                 self.dynamic_sampling_max_draws, "a number >= 1 (times trainer.batch_size groups)")
        _require(not self.dynamic_sampling or self.n_per_task >= 2, "rollout.dynamic_sampling", True,
                 f"only with rollout.n_per_task >= 2 (here {self.n_per_task}): one sample has no spread")
        # Greedy decoding has no sampling distribution: PPO's ratio against it (and the trainer's
        # logits / temperature) would be undefined.
        _require(self.temperature > 0, "rollout.temperature", self.temperature,
                 "a number > 0 (greedy decoding, 0, has no sampling distribution for PPO's ratio; "
                 "use e.g. 0.1 for near-greedy sampling)")
        _require(0 < self.top_p <= 1, "rollout.top_p", self.top_p, "a number in (0, 1]")
        _require(
            self.max_model_len > self.max_tokens_per_turn, "rollout.max_model_len", self.max_model_len,
            f"more than rollout.max_tokens_per_turn={self.max_tokens_per_turn}",
        )
        _require(
            0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization",
            self.gpu_memory_utilization, "a number in (0, 1]",
        )


@section
class EnvConfig:
    """Environment servers: given URLs, or `num_servers` servers started by the trainer."""

    name: Literal[KINDS] = "babyai"
    """The environment kind."""
    server_urls: list[StrictStr] = _default(list)
    """Running env servers to use; empty: the trainer starts `num_servers` of its own."""
    num_servers: StrictInt = 1
    """Env servers the trainer starts when server_urls is empty (old name: env.workers)."""
    split: Literal["train", "test"] = "train"
    """The task split trained on."""
    task_ids: Optional[list[StrictInt]] = None
    """Explicit task ids (>= 0); null: every task of the split."""
    categories: Optional[list[StrictStr]] = None
    """Only these categories (BabyAI levels, TextCraft depth-N, SciWorld tasks, Deep Search sources)."""
    instruction: Optional[StrictStr] = None
    """Opens every episode; null: the environment's own (envs/<name>/instruction.txt); "": none."""
    instruction_role: Literal[INSTRUCTION_ROLES] = "user"
    """Where the instruction goes: ahead of the first observation in the first user turn, or a system turn."""
    options: dict[StrictStr, Any] = _default(dict)
    """The kind's own settings for the servers the trainer starts (envs/<name>/options.py; Deep Search's
    retriever, WebArena's sites), checked on load; overrides reach in (env.options.topk=5)."""

    def __post_init__(self):
        try:
            envs.check_options(self.name, self.options)
        except ValueError as exc:
            raise ValueError(f"env.options: {exc}") from None
        _require(self.categories is None or bool(self.categories), "env.categories", self.categories,
                 "a non-empty list of category names, or null")
        _require(bool(self.server_urls) or self.num_servers >= 1, "env.num_servers", self.num_servers,
                 "an integer >= 1 when env.server_urls is empty")
        if self.task_ids is not None:
            bad = [t for t in self.task_ids if t < 0]
            _require(not bad and bool(self.task_ids), "env.task_ids", self.task_ids,
                     "a non-empty list of task ids >= 0, or null")


@section
class AlgorithmConfig:
    """Advantage estimator and loss terms."""

    estimator: Literal["gae", "gigpo", "grpo", "reinforce_pp", "rloo"] = "grpo"
    """The advantage estimator; gae is PPO with a critic; gigpo is grpo plus step-level credit."""
    gamma: float = 1.0
    """Discount, in [0, 1]: per token for gae and reinforce_pp, per turn for gigpo's step returns."""
    gigpo_step_weight: float = 1.0
    """gigpo's w (>= 0): a turn's advantage is its episode's grpo one plus w times its step one; 0 is grpo."""
    gigpo_state_key: Literal["exact", "whitespace", "digits"] = "exact"
    """How gigpo keys anchor states (observation text): as is, whitespace collapsed, or also numbers as #."""
    lam: float = 1.0
    """GAE's lambda, in [0, 1]."""
    clip: float = 0.2
    """PPO's ratio clip."""
    dual_clip: Optional[float] = None
    """Dual-clip constant (> 1) for negative advantages; null: off."""
    kl_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    """The KL estimator against the reference policy."""
    kl_coef: float = 0.001
    """KL coefficient; the reference policy runs only when it is > 0."""
    kl_in: Literal["loss", "reward"] = "loss"
    """KL as a loss term, or subtracted in the reward per token (gae and reinforce_pp only)."""
    entropy_coef: float = 0.001
    """Entropy bonus."""
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    """How token losses aggregate over a batch; seq-mean-token-mean weighs every episode the same."""
    value_clip: float = 0.2
    """The critic's value clip."""
    tis_cap: Optional[float] = None
    """Truncated importance sampling (>= 1): each token's policy-gradient term weighted by
    min(p_trainer / p_engine, tis_cap), for engine/trainer mismatch and staleness. null: off."""
    old_logprobs: Literal["auto", "trainer", "engine"] = "auto"
    """The PPO ratio's denominator: `trainer` recomputes it (a forward pass); `engine` takes the
    engines' log-probs (no pass; engine/trainer mismatch enters the ratio); `auto`: `engine` one
    step off-policy without tis_cap, else `trainer`."""

    def __post_init__(self):
        for key in ("gamma", "lam"):
            _require(0 <= getattr(self, key) <= 1, f"algorithm.{key}", getattr(self, key), "a number in [0, 1]")
        _require(self.clip > 0, "algorithm.clip", self.clip, "a number > 0")
        _require(self.dual_clip is None or self.dual_clip > 1, "algorithm.dual_clip", self.dual_clip,
                 "null or a number > 1")
        for key in ("kl_coef", "entropy_coef", "value_clip", "gigpo_step_weight"):
            _require(getattr(self, key) >= 0, f"algorithm.{key}", getattr(self, key), "a number >= 0")
        _require(self.tis_cap is None or self.tis_cap >= 1, "algorithm.tis_cap", self.tis_cap,
                 "null or a number >= 1")
        _require(self.tis_cap is None or self.old_logprobs != "engine", "algorithm.old_logprobs", self.old_logprobs,
                 "auto or trainer with algorithm.tis_cap (its weights need the trainer's log-probs)")


@section
class HorizonConfig:
    """Turn cap per episode: `fixed` (one cap) or `scaling_inter` (caps grow every `interval` steps)."""

    schedule: Literal["fixed", "scaling_inter"] = "fixed"
    """fixed: one cap; scaling_inter: the caps in turn, a stage every `interval` steps."""
    caps: list[StrictInt] = _default(lambda: [20])
    """Turn caps; strictly increasing for scaling_inter."""
    interval: StrictInt = 100
    """Steps per stage: caps [6, 13, 20] at interval 100 cap steps 1-100 at 6 turns, then 13, then 20."""

    def __post_init__(self):
        _require(bool(self.caps) and min(self.caps) >= 1, "horizon.caps", self.caps,
                 "a non-empty list of turn caps >= 1")
        _require(self.interval >= 1, "horizon.interval", self.interval, "an integer >= 1")
        if self.schedule == "fixed":
            _require(len(self.caps) == 1, "horizon.caps", self.caps, "exactly one cap with schedule fixed")
        else:
            _require(
                len(self.caps) >= 2 and all(a < b for a, b in zip(self.caps, self.caps[1:])),
                "horizon.caps", self.caps, "two or more strictly increasing caps with schedule scaling_inter",
            )


@section
class TrainerConfig:
    """The loop: steps, optimiser, batch sizes (in tasks), checkpointing."""

    total_steps: StrictInt = 100
    """Training steps."""
    lr: float = 1e-6
    """Learning rate."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """The learning-rate schedule (megatron's OptimizerParamScheduler)."""
    warmup_steps: StrictInt = 0
    """Linear warm-up steps."""
    min_lr: float = 0.0
    """The schedule's floor, in [0, lr]."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    batch_size: StrictInt = 32
    """Tasks per step."""
    mini_batch_size: StrictInt = 8
    """Tasks per optimiser step; divides batch_size, and times rollout.n_per_task splits over parallel.dp."""
    ppo_epochs: StrictInt = 1
    """Passes over each batch."""
    micro_batch_size: Optional[StrictInt] = None
    """Sequences per micro-batch of a rank's forward/backward passes (log-probs, values, updates);
    null: the rank's whole slice at once. A GPU holds one micro-batch's activations at a time."""
    max_tokens_per_gpu: Optional[StrictInt] = None
    """Instead of micro_batch_size: bins of like-length whole sequences within this many padded tokens."""
    save_freq: StrictInt = 0
    """Steps between checkpoints; 0: only at the end."""
    output_dir: StrictStr = "runs/default"
    """Checkpoints, metrics.jsonl, TensorBoard and the reward curve."""
    seed: StrictInt = 0
    """The global seed."""
    off_policy_steps: StrictInt = 0
    """1: step k+1's rollout runs on the engines (weights k-1) while the trainer updates step k, the
    engines' log-probs the behaviour policy. Needs cluster.placement=split and offload off."""

    def __post_init__(self):
        for key in ("total_steps", "batch_size", "mini_batch_size", "ppo_epochs"):
            _require(getattr(self, key) >= 1, f"trainer.{key}", getattr(self, key), "an integer >= 1")
        for key in ("warmup_steps", "save_freq"):
            _require(getattr(self, key) >= 0, f"trainer.{key}", getattr(self, key), "an integer >= 0")
        _require(self.off_policy_steps in (0, 1), "trainer.off_policy_steps", self.off_policy_steps,
                 "0 (on-policy) or 1 (the next rollout overlaps this step's update)")
        for key in ("micro_batch_size", "max_tokens_per_gpu"):
            value = getattr(self, key)
            _require(value is None or value >= 1, f"trainer.{key}", value, "an integer >= 1, or null")
        _require(self.micro_batch_size is None or self.max_tokens_per_gpu is None, "trainer.micro_batch_size",
                 self.micro_batch_size, "null when trainer.max_tokens_per_gpu is set (the token budget decides)")
        _require(self.lr > 0, "trainer.lr", self.lr, "a number > 0")
        _require(0 <= self.min_lr <= self.lr, "trainer.min_lr", self.min_lr, f"a number in [0, trainer.lr={self.lr}]")
        _require(self.grad_clip > 0, "trainer.grad_clip", self.grad_clip, "a number > 0")
        _require(
            self.batch_size % self.mini_batch_size == 0, "trainer.mini_batch_size", self.mini_batch_size,
            f"a divisor of trainer.batch_size={self.batch_size}",
        )


@section
class EvalConfig:
    """Held-out evaluation inside a training run, on the run's engines and env servers: n samples
    per task of `split` (kept to env.categories), reported as Avg@n, Pass@n, success and valid-action rate."""

    freq: StrictInt = 0
    """Steps between evaluations (and one after the last step); 0: never."""
    at_start: StrictBool = False
    """Also evaluate the starting policy, as step 0."""
    n: StrictInt = 1
    """Samples per task (Avg@n, Pass@n); also `agentgym-mega eval`'s default --n."""
    split: Literal["train", "test"] = "test"
    """The split evaluated."""
    max_turns: Optional[StrictInt] = None
    """The evaluation's turn limit; null: the environment's (envs.eval_max_turns)."""
    limit: Optional[StrictInt] = None
    """Only the first N tasks; null: all."""

    def __post_init__(self):
        _require(self.freq >= 0, "eval.freq", self.freq, "an integer >= 0")
        for key in ("n", "max_turns", "limit"):
            value = getattr(self, key)
            _require(value is None or value >= 1, f"eval.{key}", value, "an integer >= 1" +
                     ("" if key == "n" else ", or null"))


@section
class ClusterConfig:
    """Where Ray places the processes: `colocated` runs the engines on the trainer's GPUs (they sleep
    while it trains), `split` gives them GPUs of their own; env servers always get CPU bundles."""

    placement: Literal["colocated", "split"] = "colocated"
    """colocated needs rollout.num_engines * rollout.engine_tp <= parallel.world_size."""
    offload: Union[Literal["auto"], StrictBool] = "auto"
    """true: trainer roles hand device memory to the host while engines generate; auto: on colocated GPUs."""
    env_resource: Optional[StrictStr] = None
    """A custom Ray resource env server bundles require, so they land only on nodes offering it (the
    Slurm launch gives its CPU nodes `env_node` and sets this). null: any node with a free CPU."""


@section
class WeightSyncConfig:
    """How the actor's weights reach the engines after each step. `auto`: `cuda_ipc` for colocated
    engines on GPUs, any number of nodes (each engine worker maps buckets of the rank on its own GPU),
    `ipc` on one CPU node, else `collective` (a process group per pipeline stage, NCCL or gloo, for
    engines on GPUs of their own); `ipc` / `tcp`: every engine worker pulls the model from rank 0."""

    transport: Literal["auto", "ipc", "tcp", "cuda_ipc", "collective"] = "auto"
    """How weights travel (see the section); one the layout cannot carry is refused, naming why."""
    bucket_mb: StrictInt = 256
    """One bucket of weights: one ZMQ message; a collective member's two buffers, a CUDA IPC ring's 3 slots."""
    timeout_s: float = 600.0
    """A stream or an engine that stalls this long ends the sync; an engine that took part of it waits for a re-send."""
    on_engine_failure: Literal["drop", "stop"] = "drop"
    """An engine still without the new weights after one retry, or dead: `drop` takes it out of
    rotation (sync/engines_dropped), `stop` ends the run naming it. No engine serves stale weights."""

    def __post_init__(self):
        _require(self.bucket_mb >= 1, "weight_sync.bucket_mb", self.bucket_mb, "an integer >= 1")
        _require(self.timeout_s > 0, "weight_sync.timeout_s", self.timeout_s, "a number > 0")


@section
class EpisodesConfig:
    """Episodes saved as text, `episodes/step_N.jsonl` under trainer.output_dir (`agentgym-mega report`,
    `agentgym-mega show` read them): the turns' replies, parsed actions, observations and rewards."""

    eval: StrictBool = True
    """Every held-out episode of every evaluation."""
    train_every: StrictInt = 1
    """Training episodes of every Nth step; 0: none."""
    train_per_step: StrictInt = 4
    """At most this many training episodes per saved step (the batch's first, whole groups first)."""
    max_mb: float = 200.0
    """The run's episodes/ stops growing past this many MB (a warning says so); 0: no cap."""

    def __post_init__(self):
        for key in ("train_every", "train_per_step"):
            _require(getattr(self, key) >= 0, f"logging.episodes.{key}", getattr(self, key), "an integer >= 0")
        _require(self.max_mb >= 0, "logging.episodes.max_mb", self.max_mb, "a number >= 0")


@section
class WandbConfig:
    """Weights & Biases beside TensorBoard (the `wandb` extra), from the driver only; a resumed run
    continues the same W&B run (its id is kept in trainer.output_dir/wandb_run_id)."""

    mode: Literal["disabled", "online", "offline"] = "disabled"
    """`offline` writes the run under trainer.output_dir/wandb (`wandb sync` uploads it)."""
    project: StrictStr = "agentgym-mega"
    """The W&B project."""
    entity: Optional[StrictStr] = None
    """The W&B team or user; null: your default entity."""
    name: Optional[StrictStr] = None
    """The run's display name; null: logging.experiment."""
    tags: list[StrictStr] = _default(list)
    """Tags on the W&B run."""


@section
class LoggingConfig:
    """Where metrics go: TensorBoard and JSONL under trainer.output_dir, and the console."""

    tensorboard: StrictBool = True
    """TensorBoard event files under trainer.output_dir."""
    jsonl: StrictBool = True
    """metrics.jsonl under trainer.output_dir."""
    progress_bar: StrictBool = True
    """A console progress bar."""
    experiment: StrictStr = "agentgym-mega"
    """The run's name in logs."""
    worker_output: Union[Literal["auto"], StrictBool] = "auto"
    """Print the engines', trainer ranks' and env servers' output here (Ray's log_to_driver); `auto`:
    when joining a running cluster (RAY_ADDRESS), not for a local run (Ray's session logs)."""
    episodes: EpisodesConfig = _default(EpisodesConfig)
    """Which episodes are saved as text (see logging.episodes)."""
    wandb: WandbConfig = _default(WandbConfig)
    """Weights & Biases (see logging.wandb)."""


@section
class Config:
    model: ModelConfig = _default(ModelConfig)
    parallel: ParallelConfig = _default(ParallelConfig)
    rollout: RolloutConfig = _default(RolloutConfig)
    env: EnvConfig = _default(EnvConfig)
    algorithm: AlgorithmConfig = _default(AlgorithmConfig)
    horizon: HorizonConfig = _default(HorizonConfig)
    trainer: TrainerConfig = _default(TrainerConfig)
    eval: EvalConfig = _default(EvalConfig)
    cluster: ClusterConfig = _default(ClusterConfig)
    weight_sync: WeightSyncConfig = _default(WeightSyncConfig)
    logging: LoggingConfig = _default(LoggingConfig)

    def __post_init__(self):
        if self.algorithm.estimator in ("gigpo", "grpo", "rloo"):
            _require(self.rollout.n_per_task >= 2, "rollout.n_per_task", self.rollout.n_per_task,
                     f">= 2 with algorithm.estimator={self.algorithm.estimator} (it compares samples of one task)")
        if self.rollout.dtype is None:  # the engines sample from the policy the trainer trains
            self.rollout.dtype = self.model.dtype
        algorithm = self.algorithm
        _require(
            not (algorithm.kl_in == "reward" and algorithm.kl_coef > 0
                 and algorithm.estimator in ("gigpo", "grpo", "rloo")),
            "algorithm.kl_in", algorithm.kl_in,
            f"loss with algorithm.estimator={algorithm.estimator} (its advantage is one number per episode or turn, "
            "so a per-token KL in the reward has nowhere to go), or algorithm.kl_coef=0 for no KL",
        )
        engine_gpus = self.rollout.num_engines * self.rollout.engine_tp
        if self.cluster.placement == "colocated":
            _require(
                engine_gpus <= self.parallel.world_size, "cluster.placement", "colocated",
                f"split, or rollout.num_engines * rollout.engine_tp (here {engine_gpus}) <= "
                f"parallel.world_size={self.parallel.world_size}: colocated engines run on the trainer's GPUs",
            )
        if self.trainer.off_policy_steps:
            _require(
                self.cluster.placement == "split" and self.cluster.offload is not True, "trainer.off_policy_steps",
                self.trainer.off_policy_steps, "0 unless cluster.placement=split and cluster.offload is not true "
                "(the engines generate while the trainer updates, so they cannot share its devices)",
            )
        budget = self.trainer.max_tokens_per_gpu
        _require(budget is None or budget >= self.rollout.max_model_len, "trainer.max_tokens_per_gpu", budget,
                 f"at least rollout.max_model_len={self.rollout.max_model_len} (a micro-batch holds one whole "
                 "sequence at the least), or null")
        # Every DP rank trains on an equal slice of each mini-batch (and so of the whole batch).
        per_mini = self.trainer.mini_batch_size * self.rollout.n_per_task
        _require(
            per_mini % self.parallel.dp == 0, "trainer.mini_batch_size", self.trainer.mini_batch_size,
            f"mini_batch_size * rollout.n_per_task (here {self.trainer.mini_batch_size} * "
            f"{self.rollout.n_per_task} = {per_mini} sequences) divisible by parallel.dp={self.parallel.dp}",
        )


_ADAPTER = TypeAdapter(Config)


def _section_type(path: tuple) -> type | None:
    cls = Config
    for part in path:
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        cls = hints.get(part)
        if cls is None:
            return None
    return cls if dataclasses.is_dataclass(cls) else None


def _describe(err: dict) -> str:
    loc = tuple(str(p) for p in err["loc"])
    key = ".".join(loc) or "<top level>"
    if err["type"] == "unexpected_keyword_argument":
        parent = _section_type(loc[:-1])
        allowed = ", ".join(f.name for f in dataclasses.fields(parent)) if parent else "none"
        where = ".".join(loc[:-1]) or "the top level"
        return f"{key}: unknown key (given {err['input']!r}); keys allowed in {where}: {allowed}"
    if err["type"] == "value_error":
        return str(err["ctx"]["error"])
    if err["type"] in ("dataclass_type", "dataclass_args_type"):
        return f"{key}: expected a section (a mapping of keys), given {err['input']!r}"
    return f"{key}: {err['msg']} (given {err['input']!r})"


# Keys renamed since configs were first written: (section, old, new). The old name keeps working
# with a warning; both at once is an error.
RENAMED = (("env", "workers", "num_servers"),)
# Keys no longer read: (section, key, why). Dropped with a warning, so old configs still load.
RETIRED = (("rollout", "engine", "vLLM is the only inference backend"),)


def _upgraded(data: dict) -> dict:
    for section_name, old, new in RENAMED:
        part = data.get(section_name)
        if not isinstance(part, dict) or old not in part:
            continue
        if new in part:
            raise ConfigError(f"{section_name}.{old} and {section_name}.{new} both given: {old} is the old "
                              f"name of {new}; keep only {section_name}.{new}")
        warnings.warn(f"config key {section_name}.{old} is deprecated: use {section_name}.{new}",
                      FutureWarning, stacklevel=3)
        part = {(new if k == old else k): v for k, v in part.items()}
        data = data | {section_name: part}
    for section_name, key, why in RETIRED:
        part = data.get(section_name)
        if isinstance(part, dict) and key in part:
            warnings.warn(f"config key {section_name}.{key} is no longer read ({why}); remove it",
                          FutureWarning, stacklevel=3)
            data = data | {section_name: {k: v for k, v in part.items() if k != key}}
    return data


def validate(data: dict) -> Config:
    """Builds a Config from plain data or raises ConfigError naming every problem."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config must be a mapping of sections, given {type(data).__name__}")
    data = _upgraded(data)
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise ConfigError("invalid config:\n  " + "\n  ".join(_describe(e) for e in exc.errors())) from None


def load_config(path: str | None, overrides: list[str] = ()) -> Config:
    data = read_yaml(path) if path else {}
    return validate(apply_overrides(data, list(overrides)))


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
