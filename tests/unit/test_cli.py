"""Every subcommand explains itself; bad arguments exit 2 with argparse's message."""

import os

import pytest

from agentgym_mega import errors
from agentgym_mega.cli import build_parser
from tests.conftest import REPO, run_cli

SUBCOMMANDS = ["config", "make-tiny-model", "pretrain-tiny", "doctor", "env-server", "retriever", "bench", "train",
               "eval", "plan", "scaling", "config-reference", "preflight", "show", "report", "study"]


def test_top_level_help_lists_every_subcommand():
    result = run_cli("--help")
    assert result.returncode == 0
    for name in SUBCOMMANDS:
        assert name in result.stdout


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_subcommand_help_describes_it(name):
    result = run_cli(name, "--help")
    assert result.returncode == 0
    assert len(result.stdout.splitlines()) > 6  # a description, not just usage


def test_parser_registers_exactly_the_documented_subcommands():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted(SUBCOMMANDS)


@pytest.mark.parametrize("args,message", [
    (["doctor", "--checks", "megatron,gpu"], "unknown check"),
    (["doctor", "--layouts", "tp2,xx3"], "expected tpN, ppN or dpN"),
    (["nonsense"], "invalid choice"),
    (["env-server", "--env", "minecraft"], "invalid choice"),
    (["env-server", "--env", "babyai", "--port", "70000"], "not a port in 0-65535"),
    (["env-server", "--env", "babyai", "--max-instances", "0"], "not an integer >= 1"),
    (["env-server", "--env", "babyai", "--idle-timeout", "-5"], "not a number of seconds > 0"),
    (["env-server", "--env", "deepsearch", "--option", "topk"], "'topk' is not KEY=VALUE"),
    (["retriever", "serve", "--index", "x", "--max-topk", "0"], "not an integer >= 1"),
    (["retriever", "index"], "invalid choice"),
    (["pretrain-tiny", "--env", "sciworld", "--out", "x"], "invalid choice"),
    (["bench", "env", "--env", "textcraft", "--concurrency", "1,x"], "comma list of integers >= 1"),
    (["bench", "env", "--env", "textcraft", "--concurrency", "0"], "comma list of integers >= 1"),
    (["bench", "nothing"], "invalid choice"),
    (["bench", "sync", "--transport", "tcp"], "unknown transport(s) ['tcp']; allowed: zmq, collective"),
    (["bench", "sync", "--transport", "zmq,"], "unknown transport(s) ['']; allowed: zmq, collective"),
    (["bench", "sync", "--receivers", "1,0"], "comma list of integers >= 1"),
    (["bench", "sync", "--size-mb", "64"], "--size-mb sizes the transport mode's model"),
    (["bench", "train", "--rounds", "0"], "not an integer >= 1"),
    (["bench", "train", "--hidden", "512", "--heads", "32"], "multiple of 32"),
    (["bench", "train", "--kv-heads", "1"], "num_key_value_heads=1 is not divisible by tp=2"),
    (["pretrain-tiny", "--out", "x", "--categories", "depth-1,depth-9", "--env", "textcraft"], "unknown ['depth-9']"),
    (["pretrain-tiny", "--out", "x", "--episodes", "0"], "not an integer >= 1"),
    (["pretrain-tiny", "--out", "x", "--categories", "GoToRedBall,NoSuchLevel"], "unknown ['NoSuchLevel']"),
    (["pretrain-tiny", "--out", "x", "--hidden", "96"], "multiple of 32"),
    (["scaling", "--project", "--mfu", "0"], "not a number > 0"),
    (["scaling", "--launcher", "ssh"], "invalid choice"),
])
def test_bad_arguments_exit_2(args, message):
    result = run_cli(*args)
    assert result.returncode == 2 and message in result.stderr


def test_bench_sync_transport_options_parse():
    args = build_parser().parse_args(["bench", "sync", "--receivers", "1,2,4", "--transport", "zmq, collective"])
    assert (args.receivers, args.transport, args.size_mb) == ([1, 2, 4], ["zmq", "collective"], None)
    args = build_parser().parse_args(["bench", "sync"])  # the megatron -> vLLM mode, as before
    assert (args.tp, args.bucket_mb, args.repeats, args.receivers, args.transport) == (2, 64, 3, None, None)


def test_layouts_parse_to_tp_pp_world():
    args = build_parser().parse_args(["doctor", "--layouts", "tp2,pp2,dp4"])
    assert args.layouts == [(2, 1, 2), (1, 2, 2), (1, 1, 4)]


@pytest.mark.parametrize("args,message", [
    (["train", "--config", "configs/base.yaml", "model.path=/nonexistent"], "model.path='/nonexistent'"),
    (["eval", "--config", "configs/base.yaml", "--hf", "/nonexistent"], "--hf='/nonexistent'"),
])
def test_a_missing_model_is_refused_before_anything_starts(args, message):
    result = run_cli(*args)
    assert result.returncode == errors.EXIT_BAD_INPUT and message in result.stderr and "no config.json" in result.stderr


def test_both_clis_turn_bad_input_into_the_shared_exit_code(tmp_path, capsys):
    """A config error, a model spec error, a missing HF directory and a non-checkpoint all end the
    same way, named on stderr, before any rank or engine starts."""
    from agentgym_mega import cli
    from checkpoint_tools import convert

    assert cli.main(["config", "--config", str(tmp_path / "nowhere.yaml")]) == errors.EXIT_BAD_INPUT
    assert "nowhere.yaml" in capsys.readouterr().err
    assert cli.main(["make-tiny-model", "--out", str(tmp_path / "m"), "--hidden", "96"]) == errors.EXIT_BAD_INPUT
    assert "multiple of 32" in capsys.readouterr().err
    missing = str(tmp_path / "missing")
    assert convert.main(["import", "--hf", missing, "--out", str(tmp_path / "c")]) == errors.EXIT_BAD_INPUT
    assert "no config.json" in capsys.readouterr().err
    assert convert.main(["export", "--ckpt", str(tmp_path), "--out", str(tmp_path / "hf")]) == errors.EXIT_BAD_INPUT
    assert "not a checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "m").exists() and not (tmp_path / "c").exists() and not (tmp_path / "hf").exists()


def test_bench_learn_keeps_the_demo_schedule_in_proportion(tmp_path):
    from agentgym_mega.bench.learn import DEMO_CONFIG, overrides
    from agentgym_mega.config import load_config

    demo = load_config(DEMO_CONFIG)
    cfg = load_config(DEMO_CONFIG, overrides("gae", demo.trainer.total_steps // 2, str(tmp_path)))
    assert cfg.algorithm.estimator == "gae" and cfg.trainer.total_steps == demo.trainer.total_steps // 2
    assert cfg.horizon.interval == demo.horizon.interval // 2 and cfg.eval.freq == demo.eval.freq // 2
    assert cfg.eval.at_start and cfg.trainer.output_dir == str(tmp_path)
    assert cfg.horizon.caps == demo.horizon.caps and cfg.env.categories == demo.env.categories


def test_bench_learn_defaults_to_the_demo_config_and_its_own_estimator_and_length():
    from agentgym_mega.bench.learn import DEMO_CONFIG
    from agentgym_mega.cli.bench import learn_plan

    plan = learn_plan(build_parser().parse_args(["bench", "learn"]))
    assert plan == {"config": DEMO_CONFIG, "estimator": "grpo", "steps": 160, "settings": [],
                    "output_dir": os.path.join("runs", "bench-learn", "demo_cpu", "grpo")}
    assert DEMO_CONFIG.endswith(os.path.join("configs", "demo_cpu.yaml")) and os.path.isfile(DEMO_CONFIG)
    arms = learn_plan(build_parser().parse_args(["bench", "learn", "--off-policy-arms", "--estimator", "rloo"]))
    assert (arms["estimator"], arms["output_dir"]) == ("rloo", os.path.join("runs", "bench-learn", "demo_cpu",
                                                                            "off-policy-arms"))


def test_bench_learn_takes_the_estimator_of_the_given_config_unless_told(tmp_path):
    from agentgym_mega.bench.learn import overrides
    from agentgym_mega.cli.bench import learn_plan
    from agentgym_mega.config import load_config

    config = tmp_path / "gigpo_ds.yaml"
    config.write_text(f"include: {os.path.join(REPO, 'configs', 'deepsearch_cpu.yaml')}\n"
                      "algorithm:\n  estimator: gigpo\n")
    own = learn_plan(build_parser().parse_args(["bench", "learn", "--config", str(config), "--set", "eval.n=1"]))
    assert own == {"config": str(config), "estimator": "gigpo", "steps": 60, "settings": ["eval.n=1"],
                   "output_dir": os.path.join("runs", "bench-learn", "gigpo_ds", "gigpo")}
    told = learn_plan(build_parser().parse_args(["bench", "learn", "--config", str(config), "--estimator", "rloo",
                                                 "--steps", "30", "--output-dir", str(tmp_path / "r")]))
    assert (told["estimator"], told["steps"], told["output_dir"]) == ("rloo", 30, str(tmp_path / "r"))
    # half of Deep Search's 60 steps: its horizon stage and evaluations at half its 30 steps
    cfg = load_config(str(config), overrides(told["estimator"], told["steps"], told["output_dir"], str(config)))
    assert (cfg.env.name, cfg.algorithm.estimator) == ("deepsearch", "rloo")
    assert (cfg.trainer.total_steps, cfg.horizon.interval, cfg.eval.freq) == (30, 15, 15)
    never = tmp_path / "never.yaml"  # a config that never evaluates: bench learn still compares start and end
    never.write_text(f"include: {config}\neval:\n  freq: 0\n")
    assert load_config(str(never), overrides("grpo", 20, "x", str(never))).eval.freq == 20


def test_bench_learn_names_a_missing_config_and_says_its_defaults(tmp_path, capsys):
    from agentgym_mega import cli

    assert cli.main(["bench", "learn", "--config", str(tmp_path / "nowhere.yaml")]) == errors.EXIT_BAD_INPUT
    assert "nowhere.yaml" in capsys.readouterr().err
    helps = " ".join(run_cli("bench", "learn", "--help").stdout.split())  # as wrapped at any width
    assert "default configs/demo_cpu.yaml" in helps and "default: the config's algorithm.estimator" in helps


def test_bench_sync_config_is_valid_and_starts_no_reference():
    # the benchmark's settings must pass validation (an invalid pair once broke it unnoticed)
    from agentgym_mega.bench.sync import config
    from agentgym_mega.cluster import roles

    cfg = config("/models/trained", tp=2, bucket_mb=64)
    assert (cfg.parallel.tp, cfg.weight_sync.bucket_mb, cfg.model.path) == (2, 64, "/models/trained")
    assert roles(cfg) == ("actor",) and cfg.weight_sync.transport == "ipc"
