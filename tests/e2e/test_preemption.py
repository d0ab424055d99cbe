"""What a preempted run needs of its driver and ranks: the stop handler `agentgym-mega train`
installs for SIGTERM survives Ray's start (ray.init replaces a driver's SIGTERM handler with one
that exits at once, which would end the run mid-step instead of after the step with a
checkpoint), and the trainer ranks' collectives wait as long as they are told (a checkpoint
save's time: agentgym_mega.checkpoint_timing), megatron's groups included."""

import os
import signal

import pytest
import ray

from agentgym_mega.cli.train import stop_on_signals
from agentgym_mega.cluster import TrainerWorld
from agentgym_mega.config import load_config
from agentgym_mega.stack import init_ray_keeping_sigterm

pytestmark = pytest.mark.slow  # a local Ray (10-30 s), and a trainer rank joining its group


def test_sigterm_after_ray_starts_sets_the_stop_event_instead_of_exiting():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        stop = stop_on_signals()
        init_ray_keeping_sigterm(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
        os.kill(os.getpid(), signal.SIGTERM)  # with ray.init's handler: SystemExit(15) here
        assert stop.wait(10)
        assert ray.is_initialized()
    finally:
        ray.shutdown()
        for signum, handler in before.items():
            signal.signal(signum, handler)


def _group_timeouts_s(rank) -> dict[str, float]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from agentgym_mega import platform

    def seconds(group) -> float:  # NCCL's or gloo's options, as the rank's device has it
        return group._get_backend(platform.device()).options._timeout.total_seconds()

    return {"world": seconds(dist.distributed_c10d._get_default_group()),
            "data_parallel": seconds(parallel_state.get_data_parallel_group())}


@pytest.mark.parametrize("timeout_s,megatron_s", [(1975.5, 1980.0), (600.0, 1800.0)])
def test_the_trainer_ranks_collectives_wait_the_timeout_they_are_given(tiny_qwen2, timeout_s, megatron_s):
    # 1975.5 s: the 70B recipe's at 1 GB/s (tests/unit/test_checkpoint_timing.py); megatron's
    # groups take whole minutes (33) and never less than their default, 30.
    cfg = load_config(None, [f"model.path={tiny_qwen2}", "parallel.world_size=1", "parallel.tp=1",
                             "parallel.sequence_parallel=false"])
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        world = TrainerWorld(cfg, None, timeout_s)
        try:
            timeouts = ray.get(world.procs[0].__ray_call__.remote(_group_timeouts_s))
        finally:
            world.shutdown()
    finally:
        ray.shutdown()
    assert timeouts == {"world": timeout_s, "data_parallel": megatron_s}
