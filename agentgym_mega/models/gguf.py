"""A GGUF file as a Hugging Face model directory, the work behind
``python -m checkpoint_tools.convert from-gguf``.

transformers reads the file (its own GGUF reader: weights dequantised, config, tokenizer and chat
template from the file's metadata); this module only saves what it read as an ordinary directory
that transformers, vLLM and ``convert import`` load: ``config.json``, ``model.safetensors``, the
tokenizer files, ``chat_template.jinja``, ``generation_config.json`` and ``gguf_source.json`` (the
file's name and sha256). Weights are saved in the dtype transformers loads the file in: float32
for a quantised file such as SmolLM2's Q4_1 (the result's "dtype" names it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

from agentgym_mega.errors import BadInput
from agentgym_mega.files import atomic_dir, commit_dir

GGUF_MAGIC = b"GGUF"
SOURCE_FILE = "gguf_source.json"  # written beside the model: which file it came from, by sha256


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_file(path: str) -> None:
    """What can be told before transformers reads the file: it exists and says it is GGUF."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--gguf {path}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise BadInput(f"--gguf {path}: not a GGUF file (it starts with {magic!r}, a GGUF file with {GGUF_MAGIC!r})")


def load(path: str):
    """(model, tokenizer) as transformers reads them from GGUF file ``path``, dequantised into
    plain tensors; raises BadInput naming the file and transformers' reason when it cannot."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    _check_file(path)
    folder, name = os.path.split(os.path.abspath(path))
    try:
        # dequantize=True: plain tensors even where the `kernels` package would keep GGUF blocks,
        # and transformers then drops its GGUF quantizer marker (model.hf_quantizer, the config's
        # quantization_config), which otherwise makes save_pretrained refuse as "not serializable".
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, quantization_config=GgufConfig(dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, OSError, EOFError, IndexError) as exc:
        # transformers' and gguf's own words for a file they cannot read (an architecture without
        # GGUF support, a truncated tensor): the reason is theirs, the exit code ours.
        raise BadInput(f"--gguf {path}: transformers cannot read it: {type(exc).__name__}: {exc}") from None
    return model, tokenizer


def to_hf(gguf: str, out: str) -> dict:
    """Writes GGUF file ``gguf`` as the HF directory ``out`` (replacing any previous one, which
    stays whole until the new one is complete) and returns what was written."""
    model, tokenizer = load(gguf)
    tmp = atomic_dir(out)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, SOURCE_FILE), "w") as f:
            json.dump({"gguf": os.path.basename(gguf), "sha256": sha256(gguf)}, f, indent=2)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_dir(tmp, out)
    return {"hf": out, "architecture": model.config.architectures[0], "dtype": str(model.dtype).removeprefix("torch."),
            "parameters": sum(p.numel() for p in model.parameters()),
            # a base model's GGUF may carry no chat template: the directory then has none either
            "chat_template": tokenizer.chat_template is not None, "files": sorted(os.listdir(out))}
