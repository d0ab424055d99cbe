"""Config schema: round trip, overrides, includes, and every class of bad input -> exit 2."""

import glob
import os

import pytest
import yaml

from agentgym_mega.config import Config, ConfigError, apply_overrides, dump_yaml, load_config, validate
from tests.conftest import REPO, run_cli


def test_defaults_round_trip_through_yaml(tmp_path):
    cfg = load_config(None, ["horizon.schedule=scaling_inter", "horizon.caps=[6,13,20]"])
    path = tmp_path / "c.yaml"
    path.write_text(dump_yaml(cfg))
    assert load_config(str(path)) == cfg
    assert validate(yaml.safe_load(dump_yaml(cfg))) == cfg


def test_dotted_overrides_parse_yaml_values():
    cfg = load_config(None, [
        "trainer.total_steps=200", "trainer.lr=1e-3", "algorithm.dual_clip=3.0",
        "env.task_ids=[1, 2, 3]", "parallel.world_size=4", "parallel.tp=2", "model.critic_path=null",
        "logging.tensorboard=false",
    ])
    assert cfg.trainer.total_steps == 200
    assert cfg.trainer.lr == pytest.approx(1e-3)  # YAML reads `1e-3` as a string; float accepts it
    assert cfg.algorithm.dual_clip == 3.0
    assert cfg.env.task_ids == [1, 2, 3]
    assert (cfg.parallel.tp, cfg.parallel.dp) == (2, 2)  # dp derived from world_size / (tp * pp)
    assert cfg.logging.tensorboard is False


def test_includes_merge_deeply_and_later_keys_win(tmp_path):
    (tmp_path / "base.yaml").write_text("trainer: {total_steps: 10, lr: 0.5}\nenv: {name: textcraft}\n")
    (tmp_path / "mid.yaml").write_text("include: base.yaml\ntrainer: {total_steps: 20}\n")
    (tmp_path / "top.yaml").write_text("include: [mid.yaml]\nenv: {num_servers: 3}\n")
    cfg = load_config(str(tmp_path / "top.yaml"), ["trainer.total_steps=30"])
    assert cfg.trainer.total_steps == 30 and cfg.trainer.lr == 0.5
    assert cfg.env.name == "textcraft" and cfg.env.num_servers == 3


def test_include_cycle_and_missing_file_are_named(tmp_path):
    (tmp_path / "a.yaml").write_text("include: b.yaml\n")
    (tmp_path / "b.yaml").write_text("include: a.yaml\n")
    with pytest.raises(ConfigError, match="include cycle"):
        load_config(str(tmp_path / "a.yaml"))
    (tmp_path / "c.yaml").write_text("include: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="nowhere.yaml"):
        load_config(str(tmp_path / "c.yaml"))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml"))))
def test_shipped_configs_are_valid(path):
    assert isinstance(load_config(path), Config)


@pytest.mark.parametrize("env,caps", [("babyai", [6, 13, 20]), ("deepsearch", [5, 8, 10])])
def test_scaling_inter_config_has_the_paper_schedule(env, caps):
    cfg = load_config(os.path.join(REPO, "configs", f"{env}_scalinginter.yaml"))
    assert (cfg.env.name, cfg.horizon.schedule, cfg.horizon.caps, cfg.horizon.interval) == (
        env, "scaling_inter", caps, 100)


BAD = [
    # (overrides, text that must appear: the key, and what was given or allowed)
    (["trainer.total_stepz=5"], ["trainer.total_stepz", "unknown key", "total_steps"]),
    (["bogus.key=1"], ["bogus", "unknown key", "trainer"]),
    (["trainer.total_steps=abc"], ["trainer.total_steps", "integer", "'abc'"]),
    (["parallel.tp=true"], ["parallel.tp", "integer", "True"]),
    (["algorithm.estimator=ppo"], ["algorithm.estimator", "'grpo'", "'ppo'"]),
    (["parallel.world_size=4", "parallel.tp=3"], ["parallel.tp", "3", "divide parallel.world_size=4"]),
    (["parallel.world_size=4", "parallel.dp=3"], ["parallel.dp", "world_size / (tp * pp) = 4"]),
    (["horizon.schedule=scaling_inter", "horizon.caps=[6,20,13]"], ["horizon.caps", "strictly increasing"]),
    (["horizon.caps=[10,20]"], ["horizon.caps", "exactly one cap with schedule fixed"]),
    (["trainer.batch_size=32", "trainer.mini_batch_size=5"], ["trainer.mini_batch_size", "divisor"]),
    (["rollout.n_per_task=1"], ["rollout.n_per_task", "algorithm.estimator=grpo"]),
    (["parallel.world_size=4", "trainer.mini_batch_size=1", "rollout.n_per_task=2"],
     ["trainer.mini_batch_size", "1 * 2 = 2 sequences", "divisible by parallel.dp=4"]),
    (["cluster.placement=spread"], ["cluster.placement", "'colocated'", "'spread'"]),
    (["parallel.world_size=2", "parallel.tp=1", "rollout.num_engines=3"],
     ["cluster.placement", "split, or rollout.num_engines * rollout.engine_tp (here 3) <= parallel.world_size=2"]),
    (["rollout.top_p=0"], ["rollout.top_p", "(0, 1]"]),
    (["rollout.temperature=0"], ["rollout.temperature", "> 0", "greedy"]),
    (["rollout.dtype=float16"], ["rollout.dtype", "'bfloat16'", "'float16'"]),
    (["algorithm.kl_in=reward"], ["algorithm.kl_in", "estimator=grpo", "one number per episode", "kl_coef=0"]),
    (["algorithm.estimator=rloo", "algorithm.kl_in=reward"], ["algorithm.kl_in", "estimator=rloo"]),
    (["algorithm.dual_clip=0.5"], ["algorithm.dual_clip", "> 1"]),
    (["algorithm.tis_cap=2", "algorithm.old_logprobs=engine"], ["algorithm.old_logprobs", "'engine'", "tis_cap"]),
    (["env.categories=[]"], ["env.categories", "non-empty list"]),
    (["eval.n=0"], ["eval.n", "integer >= 1"]),
    (["eval.max_turns=0"], ["eval.max_turns", "or null"]),
    (["eval.freq=-1"], ["eval.freq", ">= 0"]),
    (["trainer.eval_freq=5"], ["trainer.eval_freq", "unknown key"]),
    (["weight_sync.transport=nccl"], ["weight_sync.transport", "'cuda_ipc'", "'nccl'"]),
    (["weight_sync.bucket_mb=0"], ["weight_sync.bucket_mb", "integer >= 1"]),
    (["weight_sync.timeout_s=0"], ["weight_sync.timeout_s", "> 0"]),
    (["cluster.env_resource=5"], ["cluster.env_resource", "5"]),
    (["logging.worker_output=sometimes"], ["logging.worker_output", "'auto'", "'sometimes'"]),
    (["trainer=3"], ["trainer", "section"]),
    (["trainer.total_steps"], ["trainer.total_steps", "section.key=value"]),
]


@pytest.mark.parametrize("overrides,expected", BAD, ids=[b[0][-1] for b in BAD])
def test_bad_values_raise_config_error_naming_the_key(overrides, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    for text in expected:
        assert text in str(err.value)


def test_cli_exits_2_with_the_key_in_the_message(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("include: " + os.path.join(REPO, "configs", "base.yaml") + "\ntrainer:\n  ppo_epoch: 2\n")
    result = run_cli("config", "--config", str(bad))
    assert result.returncode == 2
    assert "trainer.ppo_epoch" in result.stderr and "ppo_epochs" in result.stderr

    result = run_cli("config", "--config", os.path.join(REPO, "configs", "base.yaml"), "parallel.tp=3")
    assert result.returncode == 2 and "parallel.tp" in result.stderr

    (tmp_path / "broken.yaml").write_text("trainer: [unclosed\n")
    result = run_cli("config", "--config", str(tmp_path / "broken.yaml"))
    assert result.returncode == 2 and "not valid YAML" in result.stderr


def test_cli_prints_the_resolved_config(tmp_path):
    out = tmp_path / "resolved.yaml"
    result = run_cli("config", "--config", os.path.join(REPO, "configs", "babyai_fixed.yaml"),
                     "trainer.total_steps=7", "--out", str(out))
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(out.read_text())
    assert resolved["trainer"]["total_steps"] == 7
    assert resolved["horizon"] == {"schedule": "fixed", "caps": [20], "interval": 100}
    assert resolved["env"]["name"] == "babyai"  # inherited through two includes


def test_kl_in_reward_is_accepted_where_the_estimator_applies_it():
    for estimator in ("gae", "reinforce_pp"):
        assert load_config(None, [f"algorithm.estimator={estimator}", "algorithm.kl_in=reward"]).algorithm.kl_coef > 0
    # without KL there is nothing to apply (and no reference model to run)
    assert load_config(None, ["algorithm.kl_in=reward", "algorithm.kl_coef=0"]).algorithm.estimator == "grpo"


def test_kl_in_reward_with_grpo_exits_2_through_the_cli():
    result = run_cli("config", "--config", os.path.join(REPO, "configs", "base.yaml"), "algorithm.kl_in=reward")
    assert result.returncode == 2 and "algorithm.kl_in" in result.stderr


def test_engines_run_the_trainers_dtype_unless_told_otherwise():
    assert load_config(None, ["model.dtype=float32"]).rollout.dtype == "float32"
    assert load_config(None, ["model.dtype=bfloat16"]).rollout.dtype == "bfloat16"
    assert load_config(None, ["model.dtype=float32", "rollout.dtype=bfloat16"]).rollout.dtype == "bfloat16"


def test_old_env_workers_key_still_works_with_a_warning():
    with pytest.warns(FutureWarning, match="env.workers is deprecated: use env.num_servers"):
        cfg = load_config(None, ["env.workers=3"])
    assert cfg.env.num_servers == 3


def test_old_and_new_env_server_keys_together_are_refused():
    with pytest.raises(ConfigError, match="env.workers and env.num_servers both given"):
        load_config(None, ["env.workers=3", "env.num_servers=2"])


def test_retired_rollout_engine_key_is_dropped_with_a_warning():
    with pytest.warns(FutureWarning, match="rollout.engine is no longer read"):
        cfg = load_config(None, ["rollout.engine=vllm"])
    assert not hasattr(cfg.rollout, "engine")


def test_overrides_leave_the_given_dict_unchanged():
    # callers reuse one base dict for several sets of overrides (plan's nearest-layout search)
    base = {"parallel": {"tp": 2}, "trainer": {"lr": 1e-6}}
    assert apply_overrides(base, ["parallel.tp=4"])["parallel"]["tp"] == 4
    assert base == {"parallel": {"tp": 2}, "trainer": {"lr": 1e-6}}


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True)))
def test_shipped_scaling_inter_runs_reach_their_longest_cap(path):
    # with the default 100 steps and a 100-step interval a run never left its first stage
    cfg = load_config(path)
    if cfg.horizon.schedule == "scaling_inter":
        assert cfg.trainer.total_steps > cfg.horizon.interval * (len(cfg.horizon.caps) - 1), path
