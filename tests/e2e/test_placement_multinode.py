"""Placement on a simulated cluster (ray.cluster_utils.Cluster: raylets on this machine): two nodes
of 4 logical GPUs, where every trainer TP group and every engine's TP workers land on one node, and
the weight sync's `auto` transport, read from the logical devices the placement gives each
process, feeds colocated engines per GPU once they span nodes (rank 0's ZMQ stream within one
node), with no group holding a GPU twice; and a CPU node offering `env_node`, the only place env servers go once
cluster.env_resource names it."""

import pytest
import ray

from agentgym_mega.cluster import Placement, PlacementError
from agentgym_mega.config import load_config
from agentgym_mega.weight_sync import SyncLayout, choose_transport, sync_groups
from tests.e2e.test_placement import Probe

pytestmark = pytest.mark.slow  # two raylets and a dozen actor processes: about a minute on 2 cores


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 4})
    cluster.add_node(num_cpus=4, num_gpus=4)
    env_node = cluster.add_node(num_cpus=2, resources={"env_node": 2})  # a CPU node kept for env servers
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield env_node.node_id
    ray.shutdown()
    cluster.shutdown()


def config(*extra: str):
    return load_config(None, ["algorithm.kl_coef=0.0", "env.num_servers=1", "parallel.sequence_parallel=false",
                              *extra])


def nodes_of(options: list[dict]) -> list[str]:
    procs = [ray.remote(**o)(Probe).remote() for o in options]
    try:
        return [w["node"] for w in ray.get([p.where.remote() for p in procs])]
    finally:
        for proc in procs:
            ray.kill(proc)


def transport(placement: Placement, pp: int = 1) -> str:
    layout = SyncLayout.of(placement.trainer_devices, placement.worker_devices, placement.engine_tp, pp)
    chosen = choose_transport("auto", layout, cuda=False)
    assert all(not g.shared_devices() for g in sync_groups(chosen, layout, cuda=False) if g.backend == "gloo")
    return chosen


def test_tp_groups_and_engine_workers_stay_within_a_node(two_nodes):
    cfg = config("parallel.world_size=8", "parallel.tp=4", "rollout.num_engines=4", "rollout.engine_tp=2")
    placement = Placement(cfg, gpus=True)
    try:
        ranks = nodes_of([placement.trainer(r) for r in range(8)])
        assert len(set(ranks[:4])) == 1 and len(set(ranks[4:])) == 1 and ranks[0] != ranks[4]
        for engine in range(4):
            workers = placement.engine_worker_nodes()[2 * engine:2 * engine + 2]
            assert len(set(workers)) == 1, engine
        # the engines' probe (its first bundle) is where its workers are
        assert nodes_of([placement.engine(e) for e in range(4)]) == placement.engine_worker_nodes()[::2]
        # logical devices follow the nodes the ranks really landed on, and a worker shares its rank's
        assert [int(d.split(":")[0]) for d in placement.trainer_devices] == [0] * 4 + [1] * 4
        assert placement.worker_devices == placement.trainer_devices
        assert transport(placement) == "cuda_ipc"
    finally:
        placement.remove()


def test_a_run_within_one_node_syncs_over_ipc(two_nodes):
    placement = Placement(config("parallel.world_size=4", "parallel.tp=2", "rollout.num_engines=2"), gpus=True)
    try:
        ranks = nodes_of([placement.trainer(r) for r in range(4)])
        assert len(set(ranks)) == 1
        assert transport(placement) == "ipc"
    finally:
        placement.remove()


def test_env_servers_go_only_to_the_nodes_offering_the_env_resource(two_nodes):
    cfg = config("parallel.world_size=2", "rollout.num_engines=1", "env.num_servers=2",
                 "cluster.env_resource=env_node")
    placement = Placement(cfg, gpus=True)
    try:
        assert nodes_of([placement.env_server(i) for i in range(2)]) == [two_nodes, two_nodes]
        assert two_nodes not in nodes_of([placement.trainer(r) for r in range(2)])
    finally:
        placement.remove()


def test_an_env_resource_no_node_offers_is_named_at_once(two_nodes):
    cfg = config("parallel.world_size=2", "rollout.num_engines=1", "cluster.env_resource=cpu_pool")
    with pytest.raises(PlacementError, match="cluster.env_resource=cpu_pool: no node of the Ray cluster offers it"):
        Placement(cfg, gpus=True)
    assert not [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
