"""Releasing a trainer role's device memory for the engines and taking it back (cluster.offload)
loses nothing: on 2 TP ranks an actor whose optimizer state, gradients and parameters were
released between two updates ends bitwise equal to one that kept them, the reference policy
gives bitwise the same log-probs, and the critic the same loss. Released tensors hold no storage
(on GPU, tests/gpu/test_offload_gpu.py checks that the device memory itself is returned)."""

import pytest
import torch

from agentgym_mega.platform.local_ranks import run_on_local_ranks
from tests.distributed import megatron_jobs as jobs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def run(megatron_models):
    return run_on_local_ranks(jobs.offload_job, 2, megatron_models["qwen2"])[0]


def test_release_frees_the_storage_of_what_it_releases(run):
    freed = run["freed"]
    assert freed["moments"] and freed["grads"] and freed["params_kept"]  # after the first release
    assert freed["params"] and freed["ref_params"]  # after releasing the parameters too
    assert freed["restored"]


def test_an_update_after_release_and_restore_is_bitwise_the_same(run):
    assert run["metrics"] == run["plain_metrics"]
    assert run["after"].keys() == run["plain_after"].keys()
    for name, tensor in run["plain_after"].items():
        assert torch.equal(run["after"][name], tensor), name
    # the weights a sync reads while optimizer state is released are the updated ones
    first_update = run["exported_while_released"]
    assert any(not torch.equal(first_update[n], t) for n, t in run["after"].items())


def test_reference_and_critic_survive_a_release(run):
    assert torch.equal(run["ref_before"], run["ref_after"])
    assert run["critic_losses"][True] == run["critic_losses"][False]
