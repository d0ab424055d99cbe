"""`python -m checkpoint_tools.convert` as a user runs it (spawning TP * PP local gloo ranks), and the
library's `export_hf` behind it."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from agentgym_mega.models.checkpoint import CheckpointError
from agentgym_mega.models.conversion import export_hf
from tests.conftest import REPO

pytestmark = pytest.mark.slow

LOGIT_TOL = 1e-4


def convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "checkpoint_tools.convert", *args],
                          capture_output=True, text=True, timeout=600, cwd=REPO)


def _report(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def test_roundtrip_at_tp2_is_bitwise(megatron_models):
    report = _report(convert("roundtrip", "--hf", megatron_models["llama"], "--tp", "2"))
    assert report["bitwise_equal"] and report["tensors"] == 2 * 9 + 3, report


def test_import_at_tp2_compare_at_tp1_and_export(megatron_models, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = megatron_models["qwen2"]
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    _report(convert("import", "--hf", hf, "--out", ckpt, "--tp", "2"))
    assert open(os.path.join(ckpt, "latest")).read().strip() == "iter_0000000"
    report = _report(convert("compare", "--hf", hf, "--ckpt", ckpt))
    assert report["max_abs_logit_diff"] <= LOGIT_TOL and report["next_token_agreement"] == 1.0, report
    _report(convert("export", "--ckpt", ckpt, "--out", out))
    in_process = export_hf(ckpt, str(tmp_path / "hf-tp2"), tp=2)  # the library's export, as evaluation calls it
    assert in_process == str(tmp_path / "hf-tp2")
    ids = torch.arange(20)[None]
    with torch.no_grad():
        original = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)(ids).logits
        for exported_dir in (out, in_process):
            exported = AutoModelForCausalLM.from_pretrained(exported_dir, dtype=torch.float32)(ids).logits
            assert torch.equal(original, exported), exported_dir
    assert sorted(f for f in os.listdir(out) if "token" in f) == sorted(f for f in os.listdir(hf) if "token" in f)


def test_bad_input_stops_with_the_name_and_writes_nothing(megatron_models, tmp_path):
    from safetensors.torch import load_file, save_file

    out = str(tmp_path / "out")
    proc = convert("import", "--hf", str(tmp_path / "missing"), "--out", out)
    assert proc.returncode == 2 and "no config.json" in proc.stderr

    wrong_arch = tmp_path / "gpt2"
    shutil.copytree(megatron_models["qwen2"], wrong_arch)
    config = json.loads((wrong_arch / "config.json").read_text())
    (wrong_arch / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2LMHeadModel"]}))
    proc = convert("import", "--hf", str(wrong_arch), "--out", out)
    assert proc.returncode == 2 and "GPT2LMHeadModel" in proc.stderr

    bad_shape = tmp_path / "bad-shape"
    shutil.copytree(megatron_models["qwen2"], bad_shape)
    tensors = load_file(str(bad_shape / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-1]
    save_file(tensors, str(bad_shape / "model.safetensors"), metadata={"format": "pt"})
    proc = convert("import", "--hf", str(bad_shape), "--out", out)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.layers.1.mlp.up_proj.weight: shape (383, 128)" in proc.stderr
    assert not os.path.exists(out)  # nothing half-written
    proc = convert("export", "--ckpt", str(tmp_path), "--out", out)
    assert proc.returncode == 2 and "not a checkpoint" in proc.stderr
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        export_hf(str(tmp_path), out)
