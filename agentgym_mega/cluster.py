"""Ray placement groups for a run, and the trainer's ranks as Ray processes driven as one group.

Each rank is one process (:class:`RankProcess`; one GPU on clusters, one CPU process here) that
joins torch.distributed (NCCL or gloo) and holds its megatron-core shard of every trainer role of
the run: the actor's, the reference policy's and the critic's models live side by side in the
same process (the ranks of a run: :class:`TrainerWorld`), so a GPU carries one CUDA context and
one set of process groups, not one per role. A role's view of them (:class:`RoleGroup`:
:class:`PolicyGroup` for the actor and the reference policy, :class:`CriticGroup`) runs its
methods on every rank at once (megatron work is collective) and returns rank 0's answer, which
all ranks share. Weight sync runs inside the ranks: they gather HF tensors from their shards to
rank 0, which streams them to the engines.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import ray
import torch
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from agentgym_mega import platform, weight_sync
from agentgym_mega.algorithms import actor_loss, critic_loss
from agentgym_mega.config import Config, to_dict, validate
from agentgym_mega.network import host_rendezvous, reachable_ip
from agentgym_mega.rollout.batch import PolicyUpdateBatch, ValueUpdateBatch

if TYPE_CHECKING:
    from agentgym_mega.models.shard import ModelShard

# megatron is imported inside the methods that use it: only the rank processes need it, not the
# driver that imports this module.

ROLES = ("actor", "ref", "critic")
PLACEMENT_TIMEOUT_S = 600.0


class PlacementError(RuntimeError):
    """The cluster placed a run's bundles where its parallel groups cannot work."""


def _address_key(address: str) -> tuple:
    """Sorts IPv4 addresses numerically (10.0.0.9 before 10.0.0.10), anything else after them."""
    parts = address.split(".")
    return (0, tuple(int(p) for p in parts)) if len(parts) == 4 and all(p.isdigit() for p in parts) else (1, address)


def node_order(bundle_nodes: list[str], addresses: dict[str, str]) -> list[int]:
    """Bundle indices ordered by node (address, then node id), bundle index within a node: ranks
    that follow each other then share a node wherever Ray put the bundles."""
    return sorted(range(len(bundle_nodes)),
                  key=lambda b: (_address_key(addresses.get(bundle_nodes[b], "")), bundle_nodes[b], b))


def check_within_nodes(order: list[int], bundle_nodes: list[str], size: int, what: str) -> None:
    """Every run of ``size`` consecutive bundles of ``order`` (a TP group) lies on one node;
    otherwise names the group and how Ray spread the bundles."""
    for start in range(0, len(order), size):
        nodes = {bundle_nodes[b] for b in order[start:start + size]}
        if len(nodes) > 1:
            per_node: dict[str, int] = {}
            for node in bundle_nodes:
                per_node[node] = per_node.get(node, 0) + 1
            spread = ", ".join(f"{n[:8]}: {c}" for n, c in per_node.items())
            raise PlacementError(
                f"{what} {start // size} (bundles in rank order {start}-{start + size - 1}) would span "
                f"{len(nodes)} nodes: Ray placed the bundles {{{spread}}}, not in whole groups of {size} per "
                "node; give the run whole nodes (their GPU count a multiple of the TP size)")


def roles(cfg: Config) -> tuple[str, ...]:
    """The trainer roles a run has: the actor; the reference policy when a KL term is on; the
    critic for GAE."""
    return (("actor",) + (("ref",) if cfg.algorithm.kl_coef > 0 else ())
            + (("critic",) if cfg.algorithm.estimator == "gae" else ()))


def offload_on(cfg: Config, gpus: bool) -> bool:
    """Whether the trainer roles release their device memory while the engines generate:
    cluster.offload, where `auto` means on when colocated on GPUs."""
    return cfg.cluster.offload is True or (cfg.cluster.offload == "auto" and gpus
                                           and cfg.cluster.placement == "colocated")


class Placement:
    """The run's placement groups and, per process, the Ray options that put it in its bundle.

    Trainer bundles: one per trainer rank (one GPU each), holding that rank's process, which
    hosts every trainer role. `colocated`: engine j runs in trainer bundles
    j * engine_tp ... (j + 1) * engine_tp - 1, sharing their GPUs; `split`: engines get bundles
    of their own. Env servers started by the trainer get one-CPU bundles spread over the nodes
    (over those offering cluster.env_resource when it is set: CPU nodes kept for them).
    In a cluster without GPUs every device bundle is one CPU instead: the same layout on CPU.
    `with_env=False`: no bundles for env servers (a run without environments, e.g. a benchmark)."""

    def __init__(self, cfg: Config, gpus: bool, with_env: bool = True):
        if cfg.cluster.env_resource and self.env_server_count(cfg, with_env):
            self._check_resource(cfg.cluster.env_resource)  # before any group is placed
        self.device = "GPU" if gpus else "CPU"
        self.colocated = cfg.cluster.placement == "colocated"
        self.engine_tp = cfg.rollout.engine_tp
        self.num_engines = cfg.rollout.num_engines
        # Actors sharing a bundle (a trainer rank and a colocated engine) split its device evenly:
        # Ray then gives them both the same GPU.
        self.share = 1.0 / (1 + self.colocated)
        unit = {self.device: 1}
        self.trainer_group = placement_group([unit] * cfg.parallel.world_size, strategy="PACK")
        engine_bundles = cfg.rollout.num_engines * cfg.rollout.engine_tp
        self.engine_group = (self.trainer_group if self.colocated
                             else placement_group([unit] * engine_bundles, strategy="PACK"))
        servers = self.env_server_count(cfg, with_env)
        env_bundle = {"CPU": 1} | ({cfg.cluster.env_resource: 1} if cfg.cluster.env_resource else {})
        self.env_group = placement_group([env_bundle] * servers, strategy="SPREAD") if servers else None
        self.groups = [g for g in (self.trainer_group, None if self.colocated else self.engine_group, self.env_group)
                       if g is not None]
        ready, _ = ray.wait([g.ready() for g in self.groups], num_returns=len(self.groups),
                            timeout=PLACEMENT_TIMEOUT_S)
        if len(ready) < len(self.groups):
            self.remove()
            raise PlacementError(
                f"placement groups not placed after {PLACEMENT_TIMEOUT_S:.0f} s: the run needs "
                f"{[g.bundle_specs for g in self.groups]}, the cluster has {ray.cluster_resources()}")
        # Ray numbers bundles in request order, not by node: rank r takes the r-th bundle by node,
        # so megatron's TP groups (consecutive ranks) and an engine's TP workers share a node.
        addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        self.trainer_nodes = self._bundle_nodes(self.trainer_group)
        self.trainer_order = node_order(self.trainer_nodes, addresses)
        if self.colocated:
            self.engine_nodes, self.engine_order = self.trainer_nodes, self.trainer_order
        else:
            self.engine_nodes = self._bundle_nodes(self.engine_group)
            self.engine_order = node_order(self.engine_nodes, addresses)
        try:
            check_within_nodes(self.trainer_order, self.trainer_nodes, cfg.parallel.tp, "trainer TP group")
            check_within_nodes(self.engine_order[:engine_bundles], self.engine_nodes, self.engine_tp, "engine")
        except PlacementError:
            self.remove()
            raise
        self.trainer_devices, self.worker_devices = self._logical_devices()

    def _logical_devices(self) -> tuple[list[str], list[str]]:
        """A logical "node:gpu" for every trainer rank and every engine worker: nodes numbered in rank
        order, a node's GPUs in bundle order (split engines' after the trainer's), as the planner
        lays a run out. On a cluster without GPUs each process takes its own as its device
        (weight_sync.topology), the stand-in for a GPU's UUID."""
        nodes: dict[str, int] = {}
        taken: dict[str, int] = {}

        def take(node: str) -> str:
            nodes.setdefault(node, len(nodes))
            taken[node] = taken.get(node, 0) + 1
            return f"{nodes[node]}:{taken[node] - 1}"

        trainer = [take(self.trainer_nodes[b]) for b in self.trainer_order]
        workers = self.num_engines * self.engine_tp
        if self.colocated:  # engine j's workers share trainer bundles j * engine_tp ..., in rank order
            return trainer, trainer[:workers]
        return trainer, [take(self.engine_nodes[b]) for b in self.engine_order[:workers]]

    @staticmethod
    def _check_resource(name: str) -> None:
        """A resource no node offers would leave the env bundles waiting out the placement timeout."""
        if not any(n["Alive"] and n["Resources"].get(name) for n in ray.nodes()):
            raise PlacementError(
                f"cluster.env_resource={name}: no node of the Ray cluster offers it; start the env servers' "
                f"nodes with `ray start --resources '{{\"{name}\": CPUS}}'` (slurm/train_scalinginter.sh: "
                f"ENV_NODES or a hetjob), or set cluster.env_resource=null")

    @staticmethod
    def _bundle_nodes(group) -> list[str]:
        """The node id of each bundle of a placed group, by bundle index."""
        table = placement_group_table(group)["bundles_to_node_id"]
        return [table[i] for i in range(len(group.bundle_specs))]

    @staticmethod
    def env_server_count(cfg: Config, with_env: bool = True) -> int:
        """Env servers the run starts itself (none when it is given their URLs)."""
        return cfg.env.num_servers if with_env and not cfg.env.server_urls else 0

    @staticmethod
    def device_bundles(cfg: Config) -> int:
        """GPUs a run occupies (logical CPUs without GPUs): a bundle per trainer rank, plus one per
        engine worker with split placement."""
        split = cfg.cluster.placement == "split"
        return cfg.parallel.world_size + (cfg.rollout.num_engines * cfg.rollout.engine_tp if split else 0)

    @staticmethod
    def cpus_needed(cfg: Config, with_env: bool = True) -> int:
        """Logical CPUs that the bundles of a run on a cluster without GPUs reserve."""
        return Placement.device_bundles(cfg) + Placement.env_server_count(cfg, with_env)

    def _options(self, group, bundle: int, amount: float, **extra) -> dict:
        """`amount` of the bundle's device (GPU, or CPU in a cluster without GPUs)."""
        resources = {"num_gpus": amount, "num_cpus": 0} if self.device == "GPU" else {"num_cpus": amount}
        return resources | {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=bundle, **extra)}

    def trainer(self, rank: int) -> dict:
        """Ray options of trainer rank `rank` (the process of every role)."""
        return self._options(self.trainer_group, self.trainer_order[rank], self.share)

    def _engine_bundles(self, index: int) -> list[int]:
        return self.engine_order[index * self.engine_tp:(index + 1) * self.engine_tp]

    def engine(self, index: int) -> dict:
        """Ray options of engine `index`. With engine_tp > 1 (GPU) the engine's own process holds
        no GPU: vLLM's Ray executor places one worker in each of the engine's bundles."""
        bundles = self._engine_bundles(index)
        amount = self.share if self.colocated else 1.0
        if self.engine_tp == 1:
            return self._options(self.engine_group, bundles[0], amount)
        return self._options(self.engine_group, bundles[0], 0, placement_group_capture_child_tasks=True) | {
            "runtime_env": {"env_vars": {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, bundles)),
                                         "VLLM_RAY_PER_WORKER_GPUS": str(amount)}}}

    def engine_devices(self, index: int) -> list[str] | None:
        """The logical devices of engine `index`'s workers on a cluster without GPUs (None on GPUs:
        there each worker's device is its GPU's UUID)."""
        if self.device == "GPU":
            return None
        return self.worker_devices[index * self.engine_tp:(index + 1) * self.engine_tp]

    def engine_worker_nodes(self) -> list[str]:
        """The node id of every worker of every engine of the run (one per bundle)."""
        return [self.engine_nodes[b] for b in self.engine_order[:self.num_engines * self.engine_tp]]

    def nodes(self) -> dict[str, int]:
        """How many distinct nodes the run's trainer ranks, engine workers and env servers use."""
        used = {"trainer": set(self.trainer_nodes), "engines": set(self.engine_worker_nodes()),
                "env_servers": set(self._bundle_nodes(self.env_group)) if self.env_group else set()}
        return {"all": len(set().union(*used.values()))} | {k: len(v) for k, v in used.items()}

    def env_server(self, index: int) -> dict:
        return self._options(self.env_group, index, 1.0) | {"num_cpus": 1, "num_gpus": 0}

    def remove(self) -> None:
        for group in self.groups:
            remove_placement_group(group)


class RankProcess:
    """The body of one trainer rank's Ray process: joins torch.distributed once, then holds a
    model shard of each role added to it (:meth:`add_role`); every role method names the role it
    runs."""

    def host_rendezvous(self) -> dict[str, str]:
        """Hosts the rendezvous on this node (rank 0's), bound and held before any rank dials it;
        returns the variables every rank's env:// needs to join it."""
        self._rendezvous, master = host_rendezvous(reachable_ip())
        return master

    def setup(self, rank: int, world: int, master: dict[str, str], cfg: dict, device: str | None = None,
              timeout_s: float = platform.PROCESS_GROUP_TIMEOUT_S) -> None:
        """`device`: this rank's logical device on a cluster without GPUs (see Placement);
        `timeout_s`: how long a collective waits for its peers (a checkpoint save's, at least)."""
        os.environ.update(master, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
        if device is not None:
            os.environ[weight_sync.DEVICES_ENV] = device
        if not platform.has_cuda():
            torch.set_num_threads(1)  # ranks share the cores; oversubscription only slows them
        self.cfg = validate(cfg)
        platform.init_distributed(self.cfg.parallel.tp, self.cfg.parallel.pp, self.cfg.trainer.seed, timeout_s)
        self.shards: dict[str, ModelShard] = {}
        self.synchronizer = None

    def add_role(self, role: str, hf_dir: str) -> None:
        if role == "critic":
            from agentgym_mega.models.critic import MegatronCritic

            self.shards[role] = MegatronCritic(hf_dir, self.cfg)
        else:
            from agentgym_mega.models.actor import MegatronActor

            self.shards[role] = MegatronActor(hf_dir, self.cfg, trainable=role == "actor")

    def logprobs(self, role: str, input_ids: torch.Tensor, temperature: float,
                 attention_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.shards[role].logprobs(input_ids, temperature=temperature, attention_mask=attention_mask,
                                          positions=positions, entropy=False)["logprobs"]

    def values(self, role: str, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.shards[role].values(input_ids, attention_mask=attention_mask)

    def update_policy(self, role: str, batch: PolicyUpdateBatch, temperature: float) -> dict:
        """One optimizer step of the actor on `batch` with the configured objective."""
        algorithm = self.cfg.algorithm
        return self.shards[role].update(batch.tensors(), lambda logp, ent, mb: actor_loss(logp, ent, mb, algorithm),
                                        temperature=temperature)

    def update_values(self, role: str, batch: ValueUpdateBatch) -> dict:
        """One optimizer step of the critic: clipped value loss against the returns."""
        algorithm = self.cfg.algorithm
        return self.shards[role].update(batch.tensors(), lambda values, mb: critic_loss(values, mb, algorithm))

    def sync_weights(self, engines: list, version: int, engine_nodes: list[str] | None = None):
        """The actor's weights. Every rank takes part: in the export of the tensors, in the form
        the transport asks for, and in the sending it does (see config.WeightSyncConfig for the
        transports). Returns the transfer stats on rank 0. `engine_nodes`: the node id of every
        engine worker of the run (default: each engine's own node)."""
        synchronizer = self._synchronizer(engines, engine_nodes)
        if synchronizer is None:  # rank 0 could not set the sync up, and raises that
            return None
        return synchronizer.sync(self.shards["actor"].export_hf(to=synchronizer.export), engines, version)

    def _synchronizer(self, engines: list, engine_nodes: list[str] | None) -> weight_sync.WeightSynchronizer | None:
        """Built at the first sync, when the engines' nodes are known (weight_sync.for_trainer_rank)."""
        if self.synchronizer is None:
            from megatron.core import parallel_state as ps  # heavy: only trainer ranks need megatron

            sends_stage = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
            self.synchronizer = weight_sync.for_trainer_rank(
                self.cfg.weight_sync, engines, engine_nodes, workers_per_engine=self.cfg.rollout.engine_tp,
                stage=ps.get_pipeline_model_parallel_rank() if sends_stage else None, pp=self.cfg.parallel.pp,
                cuda=platform.has_cuda())
        return self.synchronizer

    def sync_groups(self) -> list[dict]:
        """The groups weight sync formed at its first sync (topology.SyncGroup.as_dict each)."""
        return self.synchronizer.groups if self.synchronizer is not None else []

    def release_memory(self, role: str, params: bool) -> None:
        self.shards[role].release_memory(params)

    def restore_memory(self, role: str) -> None:
        self.shards[role].restore_memory()

    def save_checkpoint(self, role: str, root: str, step: int, trainer_state: dict) -> str:
        return self.shards[role].save_checkpoint(root, step, trainer_state)

    def load_checkpoint(self, role: str, path: str) -> dict:
        return self.shards[role].load_checkpoint(path)


class TrainerWorld:
    """The run's `world_size` trainer rank processes (:class:`RankProcess`), joined into one
    torch.distributed world; every role's group adds its model to them."""

    def __init__(self, cfg: Config, placement: Placement | None = None,
                 timeout_s: float = platform.PROCESS_GROUP_TIMEOUT_S):
        world = cfg.parallel.world_size
        # Without a placement (tools, tests): a GPU per rank, or on CPU no reservation at all
        # (ranks share the cores).
        loose = {"num_gpus": 1} if platform.has_cuda() else {"num_cpus": 0}
        self.placement = placement
        self.procs = [ray.remote(**(placement.trainer(i) if placement else loose))(RankProcess).remote()
                      for i in range(world)]
        try:
            master = ray.get(self.procs[0].host_rendezvous.remote())
            devices = placement.trainer_devices if placement and placement.device == "CPU" else [None] * world
            ray.get([r.setup.remote(i, world, master, to_dict(cfg), devices[i], timeout_s)
                     for i, r in enumerate(self.procs)])
        except BaseException:
            self.shutdown()  # the caller never gets the ranks to shut down
            raise

    def call(self, method: str, *args):
        """``method(*args)`` on every rank at once; rank 0's result."""
        return ray.get([getattr(r, method).remote(*args) for r in self.procs])[0]

    def shutdown(self) -> None:
        for r in self.procs:
            ray.kill(r)


class RoleGroup:
    """One role's view of the trainer ranks: its model in every rank process, its methods run on
    all ranks at once, returning rank 0's result. Given the run's `ranks`, the role joins them;
    without, the group starts ranks of its own, which its shutdown ends."""

    def __init__(self, cfg: Config, hf_dir: str, role: str, placement: Placement | None = None,
                 ranks: TrainerWorld | None = None):
        if role not in ROLES:
            raise ValueError(f"role {role!r}: allowed {', '.join(ROLES)}")
        self.role = role
        self._own = ranks is None
        self.trainer_ranks = ranks or TrainerWorld(cfg, placement)
        try:
            self.trainer_ranks.call("add_role", role, hf_dir)
        except BaseException:
            self.shutdown()  # the caller never gets the group to shut down
            raise

    @property
    def rank_procs(self) -> list:
        """The Ray handles of the rank processes (shared with the run's other roles)."""
        return self.trainer_ranks.procs

    def _call(self, method: str, *args):
        return self.trainer_ranks.call(method, self.role, *args)

    def save_checkpoint(self, root: str, step: int, trainer_state: dict) -> str:
        """Writes ``root/iter_<step>`` (model, optimizer, scheduler, RNG, ``trainer_state``) and
        points ``root/latest`` at it; returns its path."""
        return self._call("save_checkpoint", root, step, trainer_state)

    def load_checkpoint(self, path: str) -> dict:
        """Loads a checkpoint (or a root's latest) into every rank; returns its trainer state
        (with ``global_step``)."""
        return self._call("load_checkpoint", path)

    def release_memory(self, params: bool = True) -> None:
        """Frees the role's device memory (gradients, optimizer state and, with ``params``, the
        parameters), keeping what must survive on the host; see models.offload."""
        self._call("release_memory", params)

    def restore_memory(self) -> None:
        """Takes back what :meth:`release_memory` freed."""
        self._call("restore_memory")

    def shutdown(self) -> None:
        """Ends the ranks if this group started them; the run's shared ranks end with the run."""
        if self._own:
            self.trainer_ranks.shutdown()


class PolicyGroup(RoleGroup):
    """The actor, or with ``trainable=False`` the frozen reference policy."""

    def __init__(self, cfg: Config, hf_dir: str, *, trainable: bool = True, placement: Placement | None = None,
                 ranks: TrainerWorld | None = None):
        super().__init__(cfg, hf_dir, "actor" if trainable else "ref", placement, ranks)

    def logprobs(self, input_ids: torch.Tensor, temperature: float, attention_mask: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T]`` log-probs of ``input_ids`` at ``temperature`` (position 0 holds 0; with an
        ``attention_mask``, 0 past each micro-batch's longest sequence; with ``positions``, e.g.
        the loss mask, computed only there and 0 elsewhere)."""
        return self._call("logprobs", input_ids, temperature, attention_mask, positions)

    def update(self, batch: PolicyUpdateBatch, temperature: float) -> dict:
        """One optimizer step on ``batch``; returns the step's loss terms, grad norm and lr."""
        return self._call("update_policy", batch, temperature)

    def sync_weights(self, engines: list, version: int):
        """Streams the current weights to ``engines`` as ``version``; returns the transfer's
        :class:`~agentgym_mega.weight_sync.SyncStats`."""
        if self.role != "actor":
            raise ValueError("only the actor's weights go to the engines")
        placement = self.trainer_ranks.placement
        nodes = placement.engine_worker_nodes() if placement else None
        return self.trainer_ranks.call("sync_weights", engines, version, nodes)

    def sync_groups(self) -> list[dict]:
        """What `agentgym-mega plan` lists as sync_groups, as this run formed them."""
        return self.trainer_ranks.call("sync_groups")


class CriticGroup(RoleGroup):
    def __init__(self, cfg: Config, hf_dir: str, placement: Placement | None = None, ranks: TrainerWorld | None = None):
        super().__init__(cfg, hf_dir, "critic", placement, ranks)

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, T]`` values, aligned as :mod:`agentgym_mega.models.critic` says."""
        return self._call("values", input_ids, attention_mask)

    def update(self, batch: ValueUpdateBatch) -> dict:
        """One optimizer step of the clipped value loss on ``batch``; returns the loss, clip
        fraction, grad norm and lr."""
        return self._call("update_values", batch)
