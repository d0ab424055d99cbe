"""How long a run's checkpoint save takes, and the two things that must outlast it: the trainer's
process-group timeout, and under Slurm the lead between the stop signal and the time limit.

A checkpoint (:mod:`agentgym_mega.models.checkpoint`) holds, for each trained role (the actor,
and the critic under GAE; the reference policy saves nothing), the model's parameters in the
model dtype and the distributed optimizer's fp32 state: Adam's two moments and, for a bf16 model,
fp32 main parameters. That is 14 bytes per parameter in bf16 (12 in fp32), counted as
:func:`agentgym_mega.memory_formulas.trainer_state` counts one rank holding the whole model. Its
write rate is a stated assumption: ``AGM_CHECKPOINT_WRITE_GBPS`` decimal GB/s over all the ranks
writing at once (default 1: a shared filesystem's share on a busy cluster; parallel filesystems
give a job more, NFS less). The ranks write their shards at once and meet in a collective when
all are done, so a rank that finishes first waits there for the save's whole time: the process
group's timeout (NCCL on GPU, gloo on CPU) is ``MARGIN`` x the save's estimate, at least
``FLOOR_S``, the 600 s it always was. Loading a checkpoint at resume moves the same bytes.

Under Slurm, ``AGM_STOP_LEAD_S`` (the job script's) is how long before the time limit the stop
signal comes; the run then finishes its step and saves. :func:`lead_warning` says when the
estimate of a step (:mod:`agentgym_mega.scaling.projection`, where it has one for the config;
else the warning covers the save only) plus a save does not fit in it, and again with the first
step's measured time.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from agentgym_mega import memory_formulas as mf
from agentgym_mega import memory_plan as mp
from agentgym_mega import platform
from agentgym_mega.cluster import roles
from agentgym_mega.errors import BadInput
from agentgym_mega.scaling import projection

WRITE_GBPS_ENV = "AGM_CHECKPOINT_WRITE_GBPS"
DEFAULT_WRITE_GBPS = 1.0
STOP_LEAD_ENV = "AGM_STOP_LEAD_S"
FLOOR_S = platform.PROCESS_GROUP_TIMEOUT_S
MARGIN = 2.0  # a shared filesystem's rate varies with the other jobs on it


def checkpoint_bytes(a: mf.Arch, roles: tuple[str, ...], dtype_bytes: int) -> int:
    """Bytes of one checkpoint of a run with these trainer roles: each trained role's parameters
    and distributed-optimizer state, with megatron's buffer padding (a few elements)."""
    total = 0
    for role in roles:
        if role != "ref":
            state = mf.trainer_state(a, 1, 1, 1, 0, dtype_bytes, value_head=role == "critic")
            total += state["params"] + state["optimizer"]
    return total


def save_seconds(nbytes: int, write_gbps: float) -> float:
    return nbytes / (write_gbps * mf.GB)


def collective_timeout_s(save_s: float) -> float:
    """The trainer's process-group timeout for a save of `save_s` seconds."""
    return max(FLOOR_S, MARGIN * save_s)


def _positive(environ: Mapping[str, str], name: str, unit: str) -> float | None:
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise BadInput(f"{name}={text!r}: expected {unit}, a number > 0")
    return value


def write_gbps(environ: Mapping[str, str] = os.environ) -> float:
    """The stated checkpoint write rate: AGM_CHECKPOINT_WRITE_GBPS, else DEFAULT_WRITE_GBPS."""
    return _positive(environ, WRITE_GBPS_ENV, "decimal GB/s over all ranks") or DEFAULT_WRITE_GBPS


def stop_lead_s(environ: Mapping[str, str] = os.environ) -> float | None:
    """Seconds between Slurm's stop signal and the time limit (AGM_STOP_LEAD_S), None outside Slurm."""
    return _positive(environ, STOP_LEAD_ENV, "seconds")


@dataclasses.dataclass(frozen=True)
class StopLead:
    """A run's save estimate and what follows from it (`agentgym-mega plan`'s "stop_lead")."""

    checkpoint_bytes: int
    write_gbps: float
    step_s: float | None  # the projection's estimate of one step; None where it has none
    step_note: str = ""  # why there is no step estimate

    @property
    def save_s(self) -> float:
        return save_seconds(self.checkpoint_bytes, self.write_gbps)

    @property
    def nccl_timeout_s(self) -> float:
        return collective_timeout_s(self.save_s)

    def as_dict(self) -> dict:
        return {"checkpoint_gb": self.checkpoint_bytes / mf.GB, "write_gbps": self.write_gbps, "save_s": self.save_s,
                "step_s": self.step_s, "step_note": self.step_note, "nccl_timeout_s": self.nccl_timeout_s}


def run_checkpoint_bytes(cfg, hf: dict) -> int:
    """checkpoint_bytes of the config's run (the model dtype as the plan takes it: auto is bf16)."""
    return checkpoint_bytes(mf.Arch.of(hf), roles(cfg), mp.dtype_bytes(cfg.model.dtype))


def trainer_timeout_s(cfg, hf: dict) -> float:
    """The process-group timeout of the config's trainer ranks, at the write rate of write_gbps()."""
    return collective_timeout_s(save_seconds(run_checkpoint_bytes(cfg, hf), write_gbps()))


def stop_lead(cfg, hf: dict, gpus_per_node: int = 8, gpu_mem_gb: float = 80.0, rate_gbps: float | None = None
              ) -> StopLead:
    """The config's figures at `rate_gbps` (default: write_gbps()), the step from the scaling
    projection at the config's own node count on nodes of `gpus_per_node` GPUs of `gpu_mem_gb`
    (its stated H100 rates and workload)."""
    nodes = mp.Layout.of(cfg, gpus_per_node, round(gpu_mem_gb * mf.GB), None).nodes_used
    try:
        row = projection.estimate(cfg, hf, nodes, projection.Hardware(), projection.Workload(), gpus_per_node,
                                  gpu_mem_gb)
    except BadInput as exc:  # e.g. the projection's episodes are longer than the config's max_model_len
        row = {"error": str(exc)}
    return StopLead(run_checkpoint_bytes(cfg, hf), rate_gbps or write_gbps(), row.get("step_s"),
                    f"no scaling projection for this config: {row['error']}" if "error" in row else "")


def lead_warning(lead_s: float, figures: StopLead, measured_step_s: float | None = None) -> str | None:
    """The warning when a step (measured, else estimated) plus a save exceeds the stop lead; None
    when they fit."""
    step_s = figures.step_s if measured_step_s is None else measured_step_s
    need = figures.save_s + (step_s or 0.0)
    if need <= lead_s:
        return None
    save = (f"one checkpoint save ({figures.checkpoint_bytes / mf.GB:,.0f} GB at {figures.write_gbps:g} GB/s, "
            f"{WRITE_GBPS_ENV}: {figures.save_s:,.0f} s)")
    if step_s is None:
        what = f"{save}; this covers the save only ({figures.step_note or 'no estimate of a step'})"
    else:
        source = "this run's first, measured" if measured_step_s is not None else "the scaling projection's estimate"
        what = f"one step ({step_s:,.0f} s, {source}) plus {save}, {need:,.0f} s"
    return (f"warning: the stop signal comes {lead_s:,.0f} s before the time limit ({STOP_LEAD_ENV}), less than "
            f"{what}. A run stopped at the time limit may be killed before its checkpoint is complete, and its "
            "requeued job then resumes from the checkpoint before. Give the job a longer lead (slurm/README.md), "
            f"or state the filesystem's measured write rate in {WRITE_GBPS_ENV} if it is faster than assumed.")


def render(block: dict) -> str:
    """The plan's "stop_lead" block (StopLead.as_dict, the lead and its warning) as text."""
    step = (f"one step ~{block['step_s']:,.0f} s (the scaling projection's estimate)" if block["step_s"] is not None
            else block["step_note"])
    lines = [f"checkpoint: {block['checkpoint_gb']:,.2f} GB, a save ~{block['save_s']:,.0f} s at "
             f"{block['write_gbps']:g} GB/s ({WRITE_GBPS_ENV}); trainer process-group timeout "
             f"{block['nccl_timeout_s']:,.0f} s ({MARGIN:g} x the save, at least {FLOOR_S:.0f} s); {step}"]
    if block["lead_s"]:
        lines.append(block["warning"] or f"stop lead {block['lead_s']:,.0f} s: a step and a save fit in it")
    return "\n".join(lines)
