"""The stop handler `agentgym-mega train` installs for SIGTERM survives Ray's start: ray.init
replaces a driver's SIGTERM handler with one that exits at once, which would end a preempted run
mid-step instead of after the step with a checkpoint."""

import os
import signal

import pytest
import ray

from agentgym_mega.cli.train import stop_on_signals
from agentgym_mega.stack import init_ray_keeping_sigterm

pytestmark = pytest.mark.slow  # a local Ray: 10-30 s


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
