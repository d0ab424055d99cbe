"""A checkpoint's bytes and save time, the trainer's process-group timeout that follows, and the
warning when a step plus a save does not fit in Slurm's stop lead: by hand, and in `plan`."""

import json
import os

import pytest

from agentgym_mega import checkpoint_timing as ct
from agentgym_mega import memory_formulas as mf
from agentgym_mega import memory_plan as mp
from agentgym_mega.cli import main
from agentgym_mega.config import load_config
from agentgym_mega.errors import BadInput
from tests.conftest import REPO

RECIPE_70B = os.path.join(REPO, "configs", "recipes", "textcraft_llama-3.1-70b.yaml")
# Llama-3.1-70B by hand, per layer: two norms 2*8192; QKV (64 + 2*8) heads * 128 = 10240 rows x
# 8192; output 8192 x 8192; FC1 2*28672 x 8192; FC2 28672 x 8192: 855,654,400. x 80 layers, plus
# the embedding and the untied LM head (128,256 rows, already a multiple of 128, x 8192) and the
# final norm: 70,553,706,496 parameters, a multiple of 128 (no buffer padding).
PARAMS_70B = 80 * 855_654_400 + 2 * 128_256 * 8192 + 8192
# bf16: 2 bytes of parameter + fp32 Adam moments (8) and main parameters (4) = 14 per parameter.
ACTOR_70B = 14 * PARAMS_70B  # 987,751,890,944 B: 987.75 s at 1 GB/s, so a timeout of 1975.50 s
# The critic: no LM head, a value head of 8192 weights and a bias (padded to 64 elements), the
# buffer padded to a multiple of 128: 69,503,041,600 -> 69,503,041,664 elements.
CRITIC_70B = 14 * 69_503_041_664
# A tiny Qwen2 (tied embedding, QKV bias) in fp32, per layer: norms 2*128; QKV (2 + 2*1) * 64 = 256
# rows x 128 and its bias 256; output 128 x 128; FC1 2*384 x 128; FC2 384 x 128: 197,120. x 2
# layers + the embedding 512 x 128 + the final norm = 459,904 (a multiple of 128).
TINY = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 512, "tie_word_embeddings": True}
TINY_FP32 = 12 * 459_904  # 4 bytes of parameter + the two fp32 moments; fp32 needs no main copy


def test_a_tiny_model_saves_in_milliseconds_and_keeps_the_floor():
    assert ct.checkpoint_bytes(mf.Arch.of(TINY), ("actor", "ref"), 4) == TINY_FP32
    assert ct.collective_timeout_s(ct.save_seconds(TINY_FP32, 1.0)) == ct.FLOOR_S == 600.0


def test_the_70b_recipe_by_hand():
    cfg = load_config(RECIPE_70B)
    hf = mp.read_architecture(cfg.model)[0]
    assert mf.total_params(mf.Arch.of(hf)) == PARAMS_70B
    assert ct.run_checkpoint_bytes(cfg, hf) == ACTOR_70B  # the actor only: the reference saves nothing
    assert ct.trainer_timeout_s(cfg, hf) == pytest.approx(1975.503781888, abs=1e-6)  # 2 x 987.75 s
    gae = load_config(RECIPE_70B, ["algorithm.estimator=gae"])
    assert ct.run_checkpoint_bytes(gae, hf) == ACTOR_70B + CRITIC_70B  # 1,960,794,474,240 B


def test_the_write_rate_and_the_lead_come_from_the_environment(monkeypatch):
    cfg = load_config(RECIPE_70B)
    hf = mp.read_architecture(cfg.model)[0]
    assert ct.write_gbps() == ct.DEFAULT_WRITE_GBPS == 1.0 and ct.stop_lead_s() is None
    monkeypatch.setenv(ct.WRITE_GBPS_ENV, "4")
    monkeypatch.setenv(ct.STOP_LEAD_ENV, "900")
    assert ct.stop_lead_s() == 900.0
    assert ct.trainer_timeout_s(cfg, hf) == 600.0  # 246.94 s at 4 GB/s: 2 x that is under the floor
    monkeypatch.setenv(ct.WRITE_GBPS_ENV, "0.5")
    assert ct.trainer_timeout_s(cfg, hf) == pytest.approx(4 * 987.751890944, abs=1e-6)


@pytest.mark.parametrize("name,value", [(ct.WRITE_GBPS_ENV, "fast"), (ct.WRITE_GBPS_ENV, "0"),
                                        (ct.STOP_LEAD_ENV, "-5"), (ct.STOP_LEAD_ENV, "inf")])
def test_a_bad_value_is_refused_naming_the_variable(name, value):
    with pytest.raises(BadInput, match=f"{name}='{value}': expected .*a number > 0"):
        (ct.write_gbps if name == ct.WRITE_GBPS_ENV else ct.stop_lead_s)({name: value})


def test_the_lead_warning_by_hand():
    figures = ct.StopLead(checkpoint_bytes=500 * 10**9, write_gbps=2.0, step_s=300.0)  # a save of 250 s
    assert ct.lead_warning(550.0, figures) is None  # 300 + 250 = 550: fits exactly
    warning = ct.lead_warning(549.0, figures)
    assert "comes 549 s before the time limit" in warning and "one step (300 s, the scaling projection's" in warning
    assert "(500 GB at 2 GB/s, AGM_CHECKPOINT_WRITE_GBPS: 250 s), 550 s" in warning
    # measured: the first step took 400 s, so 650 s are needed
    assert ct.lead_warning(600.0, figures, 400.0).count("one step (400 s, this run's first, measured)") == 1
    assert ct.lead_warning(700.0, figures, 400.0) is None
    unknown = ct.StopLead(500 * 10**9, 2.0, None, "no scaling projection for this config: why")
    assert ct.lead_warning(250.0, unknown) is None  # the save alone fits
    assert "this covers the save only (no scaling projection for this config: why)" in ct.lead_warning(249.0, unknown)


def test_a_config_without_a_projection_warns_of_the_save_only():
    cfg = load_config(None, [f"model.architecture={json.dumps(TINY)}", "model.dtype=float32", "parallel.world_size=2",
                             "parallel.tp=2", "parallel.sequence_parallel=false"])
    figures = ct.stop_lead(cfg, TINY)
    assert figures.checkpoint_bytes == TINY_FP32 and figures.step_s is None
    assert "num_key_value_heads=1 is not divisible by tp=2" in figures.step_note


def test_plan_json_has_the_stop_lead_block(capsys):
    assert main(["plan", "--config", RECIPE_70B, "--json", "--stop-lead-s", "900"]) == 0
    block = json.loads(capsys.readouterr().out)["stop_lead"]
    assert block["checkpoint_gb"] == pytest.approx(987.751890944, abs=1e-9)
    assert block["write_gbps"] == 1.0 and block["save_s"] == pytest.approx(987.751890944, abs=1e-9)
    assert block["nccl_timeout_s"] == pytest.approx(1975.503781888, abs=1e-9)
    # the projection's 8 nodes of H100s (its stated rates): a step of about two minutes
    assert 60 < block["step_s"] < 300 and block["step_note"] == ""
    assert block["lead_s"] == 900.0 and "less than one step" in block["warning"]  # 988 s alone is over 900
    assert main(["plan", "--config", RECIPE_70B, "--json", "--checkpoint-write-gbps", "4"]) == 0
    block = json.loads(capsys.readouterr().out)["stop_lead"]
    assert block["save_s"] == pytest.approx(246.937972736, abs=1e-9) and block["nccl_timeout_s"] == 600.0
    assert block["lead_s"] is None and block["warning"] is None


def test_plan_text_shows_the_figures(capsys):
    assert main(["plan", "--config", RECIPE_70B, "--stop-lead-s", "1200"]) == 0
    text = capsys.readouterr().out
    assert "checkpoint: 987.75 GB, a save ~988 s at 1 GB/s (AGM_CHECKPOINT_WRITE_GBPS); trainer process-group " \
           "timeout 1,976 s" in text
    assert "stop lead 1,200 s: a step and a save fit in it" in text  # 124 + 988 s
