"""The stated assumptions of `agentgym-mega scaling --project` (:mod:`.projection`): hardware
rates and what a step's episodes look like. Kept apart so that the CLI can offer each field as
an option without importing the planner."""

from __future__ import annotations

import dataclasses

from agentgym_mega.errors import BadInput

NODES = (1, 2, 4, 8, 16)


def _rate(default, help: str):
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Stated rates of one GPU and its links (defaults: an H100 SXM node of 8 with one 400 Gb/s
    NIC per GPU); every figure of the projection follows from these and the workload. Each
    field is a `scaling --project` option (`peak_tflops` -> --peak-tflops)."""

    peak_tflops: float = _rate(989.0, "bf16 dense tensor-core TFLOP/s of a GPU (H100 SXM datasheet: 989)")
    mfu: float = _rate(0.40, "share of that peak the trainer's and the prefill's GEMMs reach, TP inside a node "
                             "included (megatron-core reports up to 0.47 on H100; one-sequence micro-batches get less)")
    hbm_tbps: float = _rate(3.35, "HBM bandwidth of a GPU in TB/s (H100 SXM datasheet: 3.35)")
    hbm_efficiency: float = _rate(0.7, "share of the HBM bandwidth a memory-bound decode step reaches")
    nvlink_gbps: float = _rate(450.0, "NVLink GB/s per GPU per direction (H100: 900 GB/s bidirectional)")
    network_gbps: float = _rate(50.0, "network GB/s per GPU between nodes (one 400 Gb/s InfiniBand NDR NIC)")
    pcie_gbps: float = _rate(25.0, "host <-> device GB/s per GPU with pinned memory, all GPUs of a node at once")
    allreduce_us: float = _rate(10.0, "microseconds of one small NCCL all-reduce inside a node (decode's TP)")

    def __post_init__(self):
        for share in ("mfu", "hbm_efficiency"):
            if not 0 < getattr(self, share) <= 1:
                raise BadInput(f"{share}={getattr(self, share)} is a share of a peak: give a number in (0, 1]")


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a step's episodes look like (stated, not read from a run)."""

    episode_tokens: int = _rate(8192, "tokens of an episode: prompt, observations and replies")
    generated_tokens: int = _rate(2048, "of those, tokens the engine generates")
    turns: int | None = _rate(None, "env steps per episode (default: the config's largest turn cap)")
    env_step_s: float = _rate(0.05, "seconds of one env step, the slowest of a lock-step turn")
