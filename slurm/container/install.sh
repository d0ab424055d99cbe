#!/bin/bash
# Installs agentgym-mega with the pinned GPU stack into a new Python 3.11 virtual environment:
#
#   bash slurm/container/install.sh /opt/agentgym-mega/venv     # then: source VENV/bin/activate
#
# The Dockerfile and the Apptainer definition run it; on a cluster without containers, run it
# on a GPU node (it compiles Transformer Engine's PyTorch extension, about 20-40 minutes with 16
# cores). Needs: CUDA 13's nvcc and cuDNN headers (the NVIDIA PyTorch image has both; elsewhere
# set CUDA_HOME and CUDNN_PATH), `uv` or a python3.11 on PATH, and PyPI.
#
# Environment: NVTE_CUDA_ARCHS (GPU architectures to compile for, default "80;90": A100 and
# H100/H200; add 100 for B200), MAX_JOBS (compile jobs, default: the cores).
set -euo pipefail

venv=${1:?usage: install.sh VENV_DIR}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
lock=$here/constraints-gpu.txt
torch_pin=$(grep '^torch==' "$lock")
say() { echo "install.sh: $*"; }

# The NVIDIA image pins its own packages through pip's configuration (/etc/pip/constraint.txt):
# this environment is ours, held to our lock instead.
export PIP_CONFIG_FILE=/dev/null PIP_CONSTRAINT=
# TE looks for a prebuilt extension by the image's own torch version when it sees this variable;
# the venv's torch is PyPI's.
unset NVIDIA_PRODUCT_NAME

nvcc=${CUDA_HOME:-/usr/local/cuda}/bin/nvcc
[[ -x $nvcc ]] || nvcc=$(command -v nvcc || true)
if [[ -z $nvcc ]]; then
    echo "install.sh: no nvcc (CUDA_HOME=${CUDA_HOME:-unset}): Transformer Engine's extension needs CUDA 13's compiler" >&2
    exit 2
fi
cuda=$("$nvcc" --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1.\2/p')
if [[ ${cuda%%.*} != 13 ]]; then
    echo "install.sh: $nvcc is CUDA $cuda; $torch_pin is built for CUDA 13 and TE's extension must match it" >&2
    exit 2
fi
say "CUDA $cuda at $nvcc, into $venv"

if command -v uv >/dev/null; then
    uv venv --seed --python 3.11 "$venv"
elif command -v python3.11 >/dev/null; then
    python3.11 -m venv "$venv"
else
    echo "install.sh: needs uv (pip install uv) or python3.11 on PATH: the project is Python 3.11" >&2
    exit 2
fi
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip
# torch and the build tools first: TE's extension builds against this torch (no build isolation).
"${pip[@]}" install -c "$lock" "$torch_pin" setuptools wheel ninja pybind11 cmake
NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-80;90} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
    "${pip[@]}" install --no-build-isolation -c "$lock" -e "${repo}[gpu]"
"${pip[@]}" check
"$venv/bin/python" - <<'EOF'
import importlib.metadata as md
import importlib.util

import megatron.core
import torch
import vllm

assert torch.version.cuda and torch.version.cuda.startswith("13."), torch.version.cuda
# The compiled extension is there; importing TE needs a GPU driver, which an image build lacks:
# `make gpu-check` imports it on the first GPU.
assert importlib.util.find_spec("transformer_engine_torch"), "TE's PyTorch extension was not built"
print("install.sh: ok:", ", ".join(f"{p} {md.version(p)}" for p in
      ("torch", "vllm", "transformer-engine", "megatron-core", "transformers", "agentgym-mega")),
      f"(CUDA {torch.version.cuda})")
EOF
