"""Start-up and shutdown of a run, in one place: Ray, the environment servers and their client,
the task list, the tokenizer, the inference engines, the rollout manager and the trainer groups.
`train`, `eval` and the benchmarks start what they need with :meth:`Stack.start`, a context
manager that shuts down whatever was started, also when start-up itself fails halfway."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
from typing import TYPE_CHECKING, Callable, Iterator

import ray

from agentgym_mega import checkpoint_timing, platform
from agentgym_mega.cluster import CriticGroup, Placement, PolicyGroup, RoleGroup, TrainerWorld, offload_on, roles
from agentgym_mega.memory_plan import read_architecture
from agentgym_mega.rollout.engines.vllm_engine import launch_remote
from agentgym_mega.rollout.env_client import EnvClient, start_servers
from agentgym_mega.rollout.manager import RolloutManager
from agentgym_mega.rollout.tasks import select_tasks
from envs.limits import SECRET_ENV

if TYPE_CHECKING:
    from ray.actor import ActorHandle
    from transformers import PreTrainedTokenizerBase

    from agentgym_mega.config import Config
    from envs.environment import Task

# transformers is imported where the tokenizer is loaded, after the engines are launched: its
# import takes seconds, which then overlap the engines' start-up.

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 30.0  # an engine that does not answer this long after a failed sync counts as dead


def init_ray_keeping_sigterm(**options) -> None:
    """ray.init(**options), leaving a SIGTERM handler the caller installed in place: ray.init
    replaces it with one that exits at once, which would end `agentgym-mega train` mid-step on
    Slurm's preemption instead of after the step with a checkpoint (cli.train.stop_on_signals).
    Without a handler of the caller's, Ray's stays (it shuts Ray down on the way out)."""
    ours = signal.getsignal(signal.SIGTERM)
    ray.init(**options)
    if callable(ours):
        signal.signal(signal.SIGTERM, ours)


def env_servers(cfg: Config, options: Callable[[int], dict] | None = None
                ) -> tuple[list[ActorHandle], list[str], str | None]:
    """(server processes, urls, secret) of a run: `env.server_urls` with the secret in
    $AGENTGYM_MEGA_SECRET (if their servers were given one), or `env.num_servers` servers
    started here with a fresh secret, which they require of every request (they bind the node's
    address on a multi-node cluster). `options(i)`: server i's Ray options."""
    if cfg.env.server_urls:
        return [], list(cfg.env.server_urls), os.environ.get(SECRET_ENV) or None
    secret = secrets.token_urlsafe(32)
    procs, urls = start_servers(cfg.env.name, cfg.env.num_servers, options=options, secret=secret,
                                 env_options=cfg.env.options)
    return procs, urls, secret


class EngineSyncError(RuntimeError):
    """Engines that did not take a weight update (weight_sync.on_engine_failure=stop, or none left)."""


class Stack:
    """What a run has started. Parts a caller did not ask for stay None (or empty)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.placement: Placement | None = None
        self.env_servers: list[ActorHandle] = []  # the servers started here
        self.env: EnvClient | None = None
        self.catalogue: list[Task] = []  # every task the env servers offer, both splits
        self.tasks: list[Task] = []  # the run's tasks (env.split, env.task_ids, env.categories)
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.engines: list[ActorHandle] = []  # VLLMEngine processes
        self.rollout: RolloutManager | None = None  # over the engines and the env servers
        self.actor: PolicyGroup | None = None
        self.ref: PolicyGroup | None = None  # with a KL term
        self.critic: CriticGroup | None = None  # with GAE
        self.trainer_ranks: TrainerWorld | None = None  # the processes of every trainer role
        self.offload = False  # cluster.offload, resolved once the devices are known
        self.dropped_engines = 0  # taken out of rotation after a failed weight sync
        self._owns_ray = False

    @classmethod
    @contextlib.contextmanager
    def start(cls, cfg: Config, *, env: bool = True, trainers: bool = True,
              engine_model: str | None = None) -> Iterator["Stack"]:
        """Starts a run's parts: env servers and the rollout manager (`env`), engines serving
        `engine_model` (default model.path), and the trainer roles (`trainers`); shuts all of
        them down on leaving, whatever happens."""
        stack = cls(cfg)
        try:
            stack._start(env, trainers, engine_model or cfg.model.path)
            yield stack
        finally:
            stack.shutdown()

    def _start(self, env: bool, trainers: bool, engine_model: str) -> None:
        cfg = self.cfg
        if cfg.model.architecture and trainers:
            read_architecture(cfg.model)  # a recipe's model facts must be those of the checkpoint it names
        self._init_ray(env)
        gpus = ray.cluster_resources().get("GPU", 0) >= 1
        self.placement = Placement(cfg, gpus=gpus, with_env=env)
        self.offload = offload_on(cfg, gpus)
        if env:
            self.env_servers, urls, secret = env_servers(cfg, self.placement.env_server)
            self.env = EnvClient(urls, secret=secret)
            self.catalogue = self.env.tasks()
            self.tasks = select_tasks(self.catalogue, cfg.env.split, cfg.env.task_ids, cfg.env.categories)
        for i in range(cfg.rollout.num_engines):
            self.engines.append(launch_remote(
                engine_model, tp=cfg.rollout.engine_tp, dtype=cfg.rollout.dtype,
                max_model_len=cfg.rollout.max_model_len, gpu_memory_utilization=cfg.rollout.gpu_memory_utilization,
                seed=cfg.trainer.seed + i, devices=self.placement.engine_devices(i), options=self.placement.engine(i)))
        # Engines and trainer roles load at once, unless they share GPUs (vLLM sizes its KV cache
        # from the device memory it sees free while it starts) or offload orders them.
        together = not (self.offload or gpus and self.placement.colocated)
        if trainers and together:
            self._start_trainer_roles()
        # The driver's own start-up work (transformers' import alone takes seconds) comes while
        # the engines finish starting.
        self._start_rollout(env, engine_model)
        ray.get([e.health.remote() for e in self.engines])  # started before the first step's clock
        if trainers and self.offload:
            # The trainer roles load their weights (and a resume its Adam state) on the GPUs the
            # engines share: the engines sleep meanwhile, keeping the weights they were started
            # with (the first rollout serves them, no sync before it); trainer.train wakes them.
            self.engines_sleep(keep_weights=True)
        if trainers and not together:
            self._start_trainer_roles()

    def _start_rollout(self, env: bool, engine_model: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(engine_model)
        if env:
            self.rollout = RolloutManager.from_config(self.cfg, self.engines, self.env, self.tokenizer)

    def _start_trainer_roles(self) -> None:
        """One process per trainer rank hosts every role (docs/design.md, topology): the reference
        policy and the critic are models of their own in the actor's processes."""
        cfg = self.cfg
        run_roles = roles(cfg)
        timeout_s = checkpoint_timing.trainer_timeout_s(cfg, read_architecture(cfg.model)[0])
        self.trainer_ranks = TrainerWorld(cfg, self.placement, timeout_s)
        self.actor = PolicyGroup(cfg, cfg.model.path, ranks=self.trainer_ranks)
        if "ref" in run_roles:
            self.ref = PolicyGroup(cfg, cfg.model.path, trainable=False, ranks=self.trainer_ranks)
        if "critic" in run_roles:
            self.critic = CriticGroup(cfg, cfg.model.critic_path or cfg.model.path, ranks=self.trainer_ranks)

    def _init_ray(self, env: bool) -> None:
        if ray.is_initialized():
            return
        # RAY_ADDRESS (slurm/train_scalinginter.sh sets it) joins a running cluster. A local Ray
        # without GPUs is told of a CPU per bundle even on a smaller machine: the processes share
        # the cores anyway, as they would unplaced.
        joining = bool(os.environ.get("RAY_ADDRESS"))
        cpus = (None if joining or platform.has_cuda()
                else max(os.cpu_count() or 1, Placement.cpus_needed(self.cfg, with_env=env)))
        worker_output = self.cfg.logging.worker_output
        init_ray_keeping_sigterm(address=None if joining else "local", num_cpus=cpus, include_dashboard=False,
                                 log_to_driver=joining if worker_output == "auto" else worker_output)
        self._owns_ray = True

    def engines_sleep(self, keep_weights: bool) -> None:
        """Engines free their device memory (weights, KV cache) for the trainer; they copy their
        weights to host memory only with `keep_weights`, which a caller whose next step is a
        weight sync into every engine does not ask for (InferenceEngine.sleep)."""
        ray.get([e.sleep.remote(keep_weights) for e in self.engines])

    def engines_wake(self, tags: tuple[str, ...] | None = None) -> None:
        """Engines take back their memory: all of it, or only `tags` ("weights", "kv_cache")."""
        ray.get([e.wake.remote(tags) for e in self.engines])

    def engines_host_copy_bytes(self) -> int:
        """Bytes the engines copied through host memory for their weights since the last call:
        sleep, wake, weight-sync staging (sync/host_copy_bytes)."""
        return sum(ray.get([e.take_host_copy_bytes.remote() for e in self.engines]))

    def sync_engines(self, version: int):
        """The actor's weights to every engine in rotation as `version`; returns the transfer's
        SyncStats (None when only a retry went through). Engines that do not answer are not
        waited for; one that did not take the weights is retried once. An engine still behind,
        or dead, is then taken out of rotation and stopped (weight_sync.on_engine_failure=drop;
        logged) or ends the run (stop): every engine left serves `version`, never a mix."""
        _, dead = self._engines_behind(self.engines, None)
        live = [e for e in self.engines if e not in dead]
        stats, first = None, None
        for _ in range(2):  # the sync, and one retry of the engines it left behind
            if not live:
                break
            try:
                stats = self.actor.sync_weights(live, version)
            except Exception as exc:  # rank 0's SyncError, through Ray
                first = first or exc
            live, gone = self._engines_behind(live, version)
            dead += gone
        failed = live + dead
        if not failed:
            return stats
        names = ", ".join(f"engine {self.engines.index(e)}" for e in failed)
        why = f"{names} did not take weights version {version} ({len(dead)} dead, the rest after a retry)"
        if first is not None:
            why += f"; first error: {first}"
        if self.cfg.weight_sync.on_engine_failure == "stop" or len(failed) == len(self.engines):
            raise EngineSyncError(why)
        log.warning("%s: taken out of rotation, %d engine(s) go on", why, len(self.engines) - len(failed))
        for engine in failed:
            ray.kill(engine)
        self.engines = [e for e in self.engines if e not in failed]
        self.dropped_engines += len(failed)
        if self.rollout is not None:
            self.rollout.use_engines(self.engines)
        return stats

    @staticmethod
    def _engines_behind(engines: list[ActorHandle], version: int | None) -> tuple[list[ActorHandle], list[ActorHandle]]:
        """(engines alive but not serving `version`, engines that do not answer)."""
        behind, dead = [], []
        for engine in engines:
            try:
                if ray.get(engine.health.remote(), timeout=HEALTH_TIMEOUT_S)["version"] != version:
                    behind.append(engine)
            except (ray.exceptions.RayError, TimeoutError):
                dead.append(engine)
        return behind, dead

    def trainers(self) -> list[RoleGroup]:
        return [g for g in (self.actor, self.ref, self.critic) if g is not None]

    def trainers_release(self, actor_params: bool = True) -> None:
        """With offload on: every trainer role frees its device memory; without `actor_params`
        the actor keeps its parameters (a weight sync still reads them)."""
        if self.offload:
            for group in self.trainers():
                group.release_memory(params=actor_params or group is not self.actor)

    def trainers_restore(self, groups: list[RoleGroup] | None = None) -> None:
        """With offload on: every trainer role (or those of `groups`) takes its device memory back."""
        if self.offload:
            for group in self.trainers() if groups is None else groups:
                group.restore_memory()

    def shutdown(self) -> None:
        """Stops what was started, in reverse order; safe after a start-up that failed halfway."""
        if self.trainer_ranks is not None:
            self.trainer_ranks.shutdown()
        if self.env is not None:
            self.env.shutdown()
        for proc in self.engines + self.env_servers:
            ray.kill(proc)
        if self.placement is not None:
            self.placement.remove()
        if self._owns_ray:
            ray.shutdown()
