"""The trainer's ranks as Ray actors, driven as one group.

Each rank is one process (one GPU on clusters, one CPU process here) that joins
torch.distributed (NCCL or gloo) and holds its megatron-core shard. The driver calls a method
on every rank at once (megatron work is collective) and takes rank 0's answer, which all ranks
share. Weight sync runs inside the ranks: they gather HF tensors from their shards to rank 0,
which streams them to the engines.
"""

from __future__ import annotations

import os

import ray
import torch
import torch.distributed as dist

from agentgym_mega import platform
from agentgym_mega.config import to_dict, validate
from agentgym_mega.network import free_port, reachable_ip

ROLES = ("actor", "ref", "critic")


class TrainerRank:
    """One rank of the actor, the reference policy or the critic (a Ray actor's body)."""

    def node_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the rendezvous."""
        host = reachable_ip()
        return host, free_port(host)

    def setup(self, rank: int, world: int, master: tuple[str, int], cfg: dict, hf_dir: str, role: str) -> None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
                          MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        if not platform.has_cuda():
            torch.set_num_threads(1)  # ranks share the cores; oversubscription only slows them
        self.cfg = validate(cfg)
        platform.init_distributed(self.cfg.parallel.tp, self.cfg.parallel.pp, self.cfg.trainer.seed)
        if role == "critic":
            from agentgym_mega.critic import MegatronCritic

            self.worker = MegatronCritic(hf_dir, self.cfg)
        else:
            from agentgym_mega.actor import MegatronActor

            self.worker = MegatronActor(hf_dir, self.cfg, trainable=role == "actor")
        self.synchronizer = None

    def logprobs(self, input_ids: torch.Tensor, temperature: float) -> dict:
        return self.worker.logprobs(input_ids, temperature=temperature)

    def values(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.worker.values(input_ids)

    def update_policy(self, batch: dict, temperature: float) -> dict:
        """One optimizer step of the actor on `batch` (input_ids, loss_mask, old_logprobs,
        advantages and, with a KL loss, ref_logprobs) with the configured objective."""
        from agentgym_mega.algorithms import actor_loss

        algorithm = self.cfg.algorithm
        return self.worker.update(batch, lambda logp, ent, mb: actor_loss(logp, ent, mb, algorithm),
                                  temperature=temperature)

    def update_values(self, batch: dict) -> dict:
        """One optimizer step of the critic: clipped value loss against the returns."""
        from agentgym_mega.algorithms import value_loss

        algorithm = self.cfg.algorithm

        def loss_fn(values, mb):
            loss, clip_fraction = value_loss(values, mb["old_values"], mb["returns"], mb["loss_mask"],
                                             algorithm.value_clip, algorithm.loss_agg)
            return loss, {"value_clip_fraction": clip_fraction}

        return self.worker.update(batch, loss_fn)

    def sync_weights(self, engines: list, version: int, bucket_bytes: int, timeout_s: float):
        """Every rank takes part in the gather to rank 0, which streams to `engines` and returns
        the transfer stats."""
        named = self.worker.export_hf()
        if dist.get_rank() != 0:
            for _ in named:  # the gather is collective: take part, send nothing
                pass
            return None
        if self.synchronizer is None:
            from agentgym_mega.weight_sync import ZmqWeightSynchronizer

            self.synchronizer = ZmqWeightSynchronizer(bucket_bytes=bucket_bytes, timeout_s=timeout_s)
        return self.synchronizer.sync(named, engines, version)

    def save_checkpoint(self, root: str, step: int, trainer_state: dict) -> str:
        return self.worker.save_checkpoint(root, step, trainer_state)

    def load_checkpoint(self, path: str) -> dict:
        return self.worker.load_checkpoint(path)


class TrainerGroup:
    """`world_size` TrainerRank actors of one role, set up and called together."""

    def __init__(self, cfg, hf_dir: str, role: str = "actor"):
        if role not in ROLES:
            raise ValueError(f"role {role!r}: allowed {', '.join(ROLES)}")
        world = cfg.parallel.world_size
        # A GPU per rank on clusters; on CPU ranks share the cores, so they reserve none.
        resources = {"num_gpus": 1} if platform.has_cuda() else {"num_cpus": 0}
        remote = ray.remote(**resources)(TrainerRank)
        self.ranks = [remote.remote() for _ in range(world)]
        master = ray.get(self.ranks[0].node_address.remote())
        ray.get([r.setup.remote(i, world, master, to_dict(cfg), hf_dir, role) for i, r in enumerate(self.ranks)])

    def call(self, method: str, *args):
        """Runs `method` on every rank (collective work) and returns rank 0's result."""
        return ray.get([getattr(r, method).remote(*args) for r in self.ranks])[0]

    def shutdown(self) -> None:
        for r in self.ranks:
            ray.kill(r)


class Stack:
    """Everything a run needs, started from its config: Ray, environment servers, inference
    engines and the trainer groups (actor; reference policy when a KL term is on; critic for GAE)."""

    def __init__(self, cfg):
        from transformers import AutoTokenizer

        from agentgym_mega.rollout.engines.vllm_engine import launch_remote
        from agentgym_mega.rollout.env_client import EnvClient, start_servers
        from agentgym_mega.rollout.manager import Task

        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        self.cfg = cfg
        self.env_servers, urls = [], list(cfg.env.server_urls)
        if not urls:
            self.env_servers, urls = start_servers(cfg.env.name, cfg.env.workers)
        self.env = EnvClient(urls)
        if cfg.env.task_ids is None:
            self.tasks = [Task(t["id"], t["category"]) for t in self.env.tasks(cfg.env.split)]
        else:  # explicit ids keep each env's meaning (large ids too); categories where listed
            category = {t["id"]: t["category"] for t in self.env.tasks()}
            self.tasks = [Task(i, category.get(i, "")) for i in cfg.env.task_ids]
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.engines = [
            launch_remote(cfg.model.path, tp=cfg.rollout.engine_tp, max_model_len=cfg.rollout.max_model_len,
                          gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, seed=cfg.trainer.seed + i)
            for i in range(cfg.rollout.num_engines)
        ]
        ray.get([e.health.remote() for e in self.engines])  # started before the first step's clock
        self.actor = TrainerGroup(cfg, cfg.model.path, "actor")
        kl_on = cfg.algorithm.kl_coef > 0
        self.ref = TrainerGroup(cfg, cfg.model.path, "ref") if kl_on else None
        self.critic = (TrainerGroup(cfg, cfg.model.critic_path or cfg.model.path, "critic")
                       if cfg.algorithm.estimator == "gae" else None)

    def call_engines(self, method: str) -> None:
        ray.get([getattr(e, method).remote() for e in self.engines])

    def shutdown(self) -> None:
        for group in (self.actor, self.ref, self.critic):
            if group is not None:
                group.shutdown()
        self.env.shutdown()
        for actor in self.engines + self.env_servers:
            ray.kill(actor)
