"""Placement groups on a local Ray told of 4 logical GPUs (no hardware needed): the options
cluster.Placement gives each process put it where the layout says. Probe processes report what Ray
assigned them (placement group, GPU ids); colocated engines share the trainer's GPUs, split
engines get others, env servers get CPUs only."""

import pytest
import ray

from agentgym_mega.cluster import Placement
from agentgym_mega.config import load_config

pytestmark = pytest.mark.slow  # eighteen actor processes: about 30 s on 2 idle cores


class Probe:
    def where(self) -> dict:
        context = ray.get_runtime_context()
        return {"group": context.get_placement_group_id(), "node": context.get_node_id(),
                "gpus": sorted(ray.get_gpu_ids()), "resources": context.get_assigned_resources()}


@pytest.fixture(scope="module")
def logical_gpus():
    ray.init(address="local", num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def layouts(logical_gpus) -> dict:
    """Where each probe landed, per layout (processes start slowly on 2 cores: each layout once)."""
    return {"colocated": landed(config("colocated")), "split": landed(config("split")),
            "cpu": landed(config("colocated"), gpus=False)}


def config(placement: str, *extra: str):
    # kl on: the reference policy's model is in the trainer ranks' processes, which take no more of a bundle
    return load_config(None, ["parallel.world_size=2", "parallel.tp=1", "rollout.num_engines=2",
                              "algorithm.kl_coef=0.001", "env.num_servers=2", f"cluster.placement={placement}", *extra])


def landed(cfg, gpus: bool = True) -> dict:
    placement = Placement(cfg, gpus=gpus)
    try:
        probes = {("trainer", i): placement.trainer(i) for i in range(2)}
        probes |= {("engine", i): placement.engine(i) for i in range(2)}
        probes |= {("env", i): placement.env_server(i) for i in range(2)}
        procs = {key: ray.remote(**options)(Probe).remote() for key, options in probes.items()}
        where = dict(zip(procs, ray.get([p.where.remote() for p in procs.values()])))
        for proc in procs.values():
            ray.kill(proc)
        return where | {"groups": {name: g.id.hex() for name, g in
                                   (("trainer", placement.trainer_group), ("engine", placement.engine_group))}}
    finally:
        placement.remove()


def test_colocated_engines_share_the_trainer_bundles(layouts):
    where = layouts["colocated"]
    trainer_group = where["groups"]["trainer"]
    assert where["groups"]["engine"] == trainer_group
    for i in range(2):
        trainer, engine = where[("trainer", i)], where[("engine", i)]
        assert trainer["group"] == engine["group"] == trainer_group
        assert len(trainer["gpus"]) == 1 and trainer["gpus"] == engine["gpus"]  # one GPU, two processes
        assert trainer["resources"] == engine["resources"] == {"GPU": pytest.approx(0.5)}
    assert where[("trainer", 0)]["gpus"] != where[("trainer", 1)]["gpus"]


def test_split_engines_get_their_own_bundles(layouts):
    where = layouts["split"]
    trainer_gpus = {g for i in range(2) for g in where[("trainer", i)]["gpus"]}
    engine_gpus = [where[("engine", i)]["gpus"] for i in range(2)]
    assert len(trainer_gpus) == 2 and all(len(g) == 1 for g in engine_gpus)
    assert not trainer_gpus & set(engine_gpus[0] + engine_gpus[1]) and engine_gpus[0] != engine_gpus[1]
    assert where["groups"]["engine"] != where["groups"]["trainer"]
    for i in range(2):
        assert where[("engine", i)]["group"] == where["groups"]["engine"]
        assert where[("trainer", i)]["group"] == where["groups"]["trainer"]
        assert where[("trainer", i)]["resources"] == {"GPU": 1.0}  # every role in one process per GPU


@pytest.mark.parametrize("placement", ["colocated", "split", "cpu"])
def test_env_servers_get_cpu_bundles_of_their_own(layouts, placement):
    where = layouts[placement]
    for i in range(2):
        server = where[("env", i)]
        assert server["gpus"] == [] and server["resources"] == {"CPU": 1.0}
        assert server["group"] not in where["groups"].values()


def test_without_gpus_the_same_layout_uses_cpu_bundles(layouts):
    where = layouts["cpu"]
    assert all(w["gpus"] == [] for key, w in where.items() if key != "groups")
    assert where[("engine", 0)]["group"] == where[("trainer", 0)]["group"]
    assert where[("trainer", 0)]["resources"] == {"CPU": pytest.approx(0.5)}


def test_engine_tp_spans_consecutive_bundles_through_vllms_ray_executor(logical_gpus):
    placement = Placement(config("split", "rollout.engine_tp=2", "rollout.num_engines=1"), gpus=True)
    try:
        options = placement.engine(0)
        assert options["num_gpus"] == 0  # vLLM's workers hold the GPUs, one per bundle
        assert options["runtime_env"]["env_vars"] == {"VLLM_RAY_BUNDLE_INDICES": "0,1",
                                                      "VLLM_RAY_PER_WORKER_GPUS": "1.0"}
        assert options["scheduling_strategy"].placement_group_capture_child_tasks
    finally:
        placement.remove()


def test_a_cluster_too_small_is_named(logical_gpus, monkeypatch):
    monkeypatch.setattr("agentgym_mega.cluster.PLACEMENT_TIMEOUT_S", 1.0)
    with pytest.raises(RuntimeError, match="placement groups not placed"):
        Placement(config("split", "parallel.world_size=4"), gpus=True)  # 4 + 2 GPUs of 4
