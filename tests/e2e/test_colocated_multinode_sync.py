"""A colocated run over two simulated nodes (ray.cluster_utils.Cluster: two raylets of one CPU
each, so the placement puts one trainer rank and its engine on each node): a megatron-core actor
at PP=2, one stage per node, and two vLLM engines, each on a trainer rank's logical GPU. `auto`
feeds each engine from the trainer rank on its GPU (the GPU path's CUDA IPC, with host buckets),
no process group is formed around an engine, the groups are exactly those `agentgym-mega plan`
lists for the same layout, and both engines serve the trained weights with log-prob parity."""

import pytest
import ray

from agentgym_mega.cli.plan import sync_groups as plan_groups
from agentgym_mega.config import load_config
from agentgym_mega.rollout.batch import PolicyUpdateBatch
from agentgym_mega.rollout.engines import SamplingConfig
from tests.e2e.test_megatron_to_vllm import logprob_gap, sequences

pytestmark = pytest.mark.slow  # two raylets, two trainer ranks and two CPU engines: a few minutes on 2 cores

MEAN_TOLERANCE = 1e-5  # mean |logprob diff| over sampled tokens, fp32 (as the collective's own test)
PROMPTS = [[1, 5, 9, 20, 33, 7], [1, 7, 7, 7], [1, 300, 12, 40]]
SAMPLING = SamplingConfig(temperature=1.0, max_tokens=10)
SEEDS = [3, 4, 5]
STAND_IN = {"host_ipc": "cuda_ipc", "gloo": "nccl"}  # what a CPU run forms in place of the GPU path


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield
    ray.shutdown()
    cluster.shutdown()


def test_two_node_colocated_run_feeds_each_engine_from_the_rank_on_its_gpu(two_nodes, tmp_path):
    from agentgym_mega.cluster import Placement, PolicyGroup
    from agentgym_mega.models.tiny import TinySpec, make_tiny_model
    from agentgym_mega.rollout.engines.vllm_engine import launch_remote

    model = make_tiny_model(str(tmp_path / "qwen2"), TinySpec(arch="qwen2", kv_heads=2))
    cfg = load_config(None, [
        "parallel.world_size=2", "parallel.pp=2", "parallel.sequence_parallel=false", "model.dtype=float32",
        "trainer.lr=0.01", "trainer.batch_size=3", "trainer.mini_batch_size=3", "algorithm.kl_coef=0",
        "algorithm.entropy_coef=0", "rollout.num_engines=2", "cluster.placement=colocated",
        "weight_sync.transport=auto", "weight_sync.bucket_mb=1", "weight_sync.timeout_s=120",
    ])
    placement = Placement(cfg, gpus=False, with_env=False)
    group, engines = None, []
    try:
        assert placement.trainer_devices == ["0:0", "1:0"] and placement.worker_devices == ["0:0", "1:0"]
        assert len(set(placement.trainer_nodes)) == 2  # one stage per node
        group = PolicyGroup(cfg, model, placement=placement)
        engines = [launch_remote(model, tp=1, max_model_len=256, devices=placement.engine_devices(i),
                                 options=placement.engine(i)) for i in range(2)]
        generated = ray.get(engines[0].generate.remote(PROMPTS, SAMPLING, SEEDS))
        ids, mask = sequences(PROMPTS, generated)
        old = group.logprobs(ids, 1.0)
        group.update(PolicyUpdateBatch(ids, loss_mask=mask, old_logprobs=old, advantages=mask.clone()), 1.0)
        assert logprob_gap(group, PROMPTS, generated).mean() > 100 * MEAN_TOLERANCE  # the step moved the weights

        stats = group.sync_weights(engines, 1)
        assert stats.version == 1 and stats.receivers == 2
        formed = group.sync_groups()
        assert [g["backend"] for g in formed] == ["host_ipc", "host_ipc"]  # no process group around an engine
        # what `plan` lists for GPUs, as the run formed it (host buckets standing in for CUDA IPC slots)
        assert [g | {"backend": STAND_IN[g["backend"]]} for g in formed] == plan_groups(cfg, gpus_per_node=1)
        assert [[m["role"] for m in g["members"]] for g in formed] == [["trainer rank 0", "engine 0 worker 0"],
                                                                        ["trainer rank 1", "engine 1 worker 0"]]
        for engine in engines:
            assert ray.get(engine.health.remote())["version"] == 1
            served = ray.get(engine.generate.remote(PROMPTS, SAMPLING, SEEDS))
            gap = logprob_gap(group, PROMPTS, served)
            print(f"megatron PP=2 over two nodes -> vLLM (per-GPU feed): mean |dlogp| {gap.mean():.2e}, "
                  f"max {gap.max():.2e}")
            assert gap.mean() <= MEAN_TOLERANCE and gap.max() <= 100 * MEAN_TOLERANCE
    finally:
        for engine in engines:
            ray.kill(engine)
        if group is not None:
            group.shutdown()
        placement.remove()
