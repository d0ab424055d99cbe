"""The shipped SmolLM2-135M-Instruct configs (configs/real/smollm2_<env>.yaml, issue 41 section 4):
one per environment kind, each valid, on the converted model, behind the environment's own
instruction, split so that megatron can hold SmolLM2's 9 heads and 3 KV heads."""

import os

import pytest

import envs
from agentgym_mega.config import load_config
from agentgym_mega.models.gpt import check_split

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("env", envs.KINDS)
def test_smollm2_config_of_every_env_loads_and_validates(env):
    cfg = load_config(os.path.join(REPO, "configs", "real", f"smollm2_{env}.yaml"))
    assert (cfg.env.name, cfg.model.path) == (env, "runs/models/smollm2-135m-instruct")
    assert cfg.env.instruction is None and envs.instruction(env)  # null: the environment's own, not none
    # SmolLM2-135M: 30 layers, 9 heads, 3 KV heads, MLP 1536 (the converted config.json's figures)
    check_split(30, 9, 3, 1536, cfg.parallel.tp, cfg.parallel.pp)
    # kept small enough for a 2-core machine, and within SmolLM2's 8,192-token context
    assert cfg.eval.n >= 2 and cfg.eval.limit <= 10 and cfg.eval.max_turns <= envs.eval_max_turns(env)
    assert cfg.rollout.max_model_len <= 8192 and cfg.rollout.num_engines == 1
