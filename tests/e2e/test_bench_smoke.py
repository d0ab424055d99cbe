"""Every benchmark runs end to end at its smallest settings and reports what its docs say it does.

Speed is never asserted here (benchmarks measure it); each test runs the real benchmark, mostly
through the CLI as a user would, on one tiny model, and checks the report's keys and that its
figures are finite and, where they count something that happened, positive. A refactor that
breaks a benchmark, or drops a figure a docs entry quotes, fails here rather than at the next
measurement."""

import json
import math

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.slow

# Two KV heads, so TP=2 can split them; head_dim 32, which vLLM's CPU attention supports.
TINY = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "vocab": 512}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from agentgym_mega.models.tiny import TinySpec, make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("bench") / "qwen2"), TinySpec(arch="qwen2", **TINY))


def _numbers(value, path="report"):
    """(path, number) of every number in a JSON report, however nested."""
    if isinstance(value, bool):
        return
    if isinstance(value, (int, float)):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{path}[{i}]")


def _bench(tmp_path, *args: str) -> dict:
    """`agentgym-mega bench ARGS --json F` in a fresh process; the report it wrote, every number finite."""
    out = tmp_path / "report.json"
    done = run_cli("bench", *args, "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    bad = [(p, v) for p, v in _numbers(report) if not math.isfinite(v)]
    assert not bad, bad
    return report


def _positive(report: dict, *paths: str) -> None:
    for path in paths:
        value = report
        for key in path.split("."):
            value = value[key]
        assert isinstance(value, (int, float)) and value > 0, (path, value)


def test_bench_train(tmp_path):
    report = _bench(tmp_path, "train", "--layers", "1", "--hidden", "128", "--heads", "4", "--kv-heads", "2",
                    "--vocab", "512", "--batch", "1", "--seq", "32", "--rounds", "1")
    layouts = ("tp1", "tp2")
    assert report["cores"] == {"hf": 1, "tp1": 1, "tp2": 2}
    for key in ("megatron_tokens_per_s", "ratio_megatron_over_hf", "megatron_tokens_per_s_per_core",
                "ratio_megatron_over_hf_per_core"):
        assert set(report[key]) == set(layouts), key
        _positive(report, *(f"{key}.{layout}" for layout in layouts))
    _positive(report, "hf_tokens_per_s")
    assert [len(report["ratio_per_round"][layout]) for layout in layouts] == [1, 1]
    # per core is the headline divided by the layout's cores (transformers runs on one)
    for layout in layouts:
        assert report["ratio_megatron_over_hf_per_core"][layout] == pytest.approx(
            report["ratio_megatron_over_hf"][layout] / report["cores"][layout], abs=2e-3)


def test_bench_train_on_a_model_directory_leaves_out_the_splits_its_heads_refuse(tmp_path):
    """--model measures that directory (how the real-model figure is taken): SmolLM2's 9 heads /
    3 KV heads at toy size, which TP=2 cannot split, so only TP=1 runs and the report says why."""
    from agentgym_mega.models.tiny import TinySpec, make_tiny_model

    model = make_tiny_model(str(tmp_path / "llama"), TinySpec(arch="llama", layers=1, hidden=96, heads=3,
                                                               kv_heads=3, vocab=512))
    report = _bench(tmp_path, "train", "--model", model, "--batch", "1", "--seq", "32", "--rounds", "1",
                    "--warmup", "1", "--iters", "2")
    assert (report["warmup"], report["iters"]) == (1, 2)
    assert report["model"]["path"] == model and (report["model"]["heads"], report["model"]["layers"]) == (3, 1)
    assert report["cores"] == {"hf": 1, "tp1": 1} and set(report["ratio_megatron_over_hf"]) == {"tp1"}
    assert "num_attention_heads=3" in report["left_out"]["tp2"]
    _positive(report, "hf_tokens_per_s", "megatron_tokens_per_s.tp1", "ratio_megatron_over_hf_per_core.tp1")
    # the directory brings its shape: a shape option beside it is refused before anything starts
    done = run_cli("bench", "train", "--model", model, "--layers", "2")
    assert done.returncode == 2 and "--layers" in done.stderr, done.stderr[-2000:]


def test_bench_startup(tmp_path, tiny_model):
    report = _bench(tmp_path, "startup", "--model", tiny_model)
    assert len(report["tp2"]) == 2
    for rank in (report["tp1"], *report["tp2"]):
        assert set(rank) >= {"load_mb", "params_mb", "rss_before_mb", "seconds", "device_mb", "on_device"}
        assert rank["params_mb"] > 0 and rank["seconds"] > 0 and rank["rss_before_mb"] > 0 and rank["on_device"]
    for rank in report["tp2"]:  # each TP=2 rank holds about half the shard
        assert rank["params_mb"] == pytest.approx(report["tp1"]["params_mb"] / 2, rel=0.05)
    _positive(report, "tp2_share_of_tp1")


def test_bench_engine(tmp_path, tiny_model):
    report = _bench(tmp_path, "engine", "--model", tiny_model, "--prompts", "4", "--prompt-len", "16",
                    "--max-tokens", "8", "--rounds", "2")
    _positive(report, "wrapper_tokens_per_s", "direct_tokens_per_s")
    assert [len(report["samples_tokens_per_s"][side]) for side in ("wrapper", "direct")] == [2, 2]
    assert "overhead_pct" in report


def test_bench_rollout(tmp_path, tiny_model):
    report = _bench(tmp_path, "rollout", "--model", tiny_model, "--tasks", "2", "--n-per-task", "2",
                    "--latency-ms", "1", "--repeats", "1")
    assert [row["mode"] for row in report["rows"]] == ["lockstep", "async"]
    for row in report["rows"]:
        assert row["episodes"] == 4 and row["turns"] >= 4 and len(row["samples"]) == 1
        assert 0 < row["engine_busy_fraction"] <= 1
        _positive(row, "episodes_per_s", "seconds")
    assert report["same_tokens_in_every_mode"] is True
    _positive(report, "speedup_vs_lockstep.async")


def test_bench_sync_megatron_mode(tiny_model):
    from agentgym_mega.bench import sync

    model = {k: v for k, v in TINY.items() if k != "vocab"}
    report = sync.run(tp=2, bucket_mb=1, repeats=2, model=model)
    _positive(report, "params", "bytes", "seconds", "gbps", "ceiling_gbps", "fraction_of_ceiling", "first_seconds",
              "first_gbps", "gather_seconds", "engine_load_seconds")
    assert len(report["all_seconds"]) == 2
    assert not [(p, v) for p, v in _numbers(report) if not math.isfinite(v)]
    # the engine generates with the synced weights: its log-probs are the trainer's
    assert report["logprob_max_abs_diff"] < 1e-3, report


def test_bench_learn_off_policy_arms(tmp_path, tiny_model):
    """The three arms, one tiny round each. The arm that skips the old-log-prob pass really skips
    it: the trainer logs no engine/trainer log-prob gap, which it logs when it recomputes them."""
    runs = tmp_path / "runs"
    settings = [f"model.path={tiny_model}", "parallel.world_size=1", "parallel.tp=1", "rollout.n_per_task=2",
                "trainer.batch_size=2", "trainer.mini_batch_size=1", "rollout.max_tokens_per_turn=8",
                "logging.progress_bar=false"]
    report = _bench(tmp_path, "learn", "--estimator", "grpo", "--steps", "2", "--rounds", "1", "--off-policy-arms",
                    "--output-dir", str(runs), *(arg for s in settings for arg in ("--set", s)))
    arms = ("lockstep", "lockstep_pass_skipped", "off_policy")
    assert tuple(report["arms"]) == arms
    assert report["arms"]["lockstep_pass_skipped"] == ["algorithm.old_logprobs=engine"]
    for key in ("steps_per_hour", "speedup_vs_lockstep", "seconds_per_step_by_phase", "steps_per_hour_per_round",
                "speedup_vs_lockstep_per_round"):
        assert set(report[key]) == set(arms), key
    _positive(report, "overlap_speedup", *(f"steps_per_hour.{arm}" for arm in arms))
    assert report["speedup_vs_lockstep"]["lockstep"] == 1.0
    logged = {arm: [json.loads(line) for line in (runs / f"{arm}-0" / "metrics.jsonl").read_text().splitlines()]
              for arm in arms}
    assert [[m["step"] for m in logged[arm]] for arm in arms] == [[1, 2]] * 3  # no evaluations
    assert all("rollout/logprob_diff" in m for m in logged["lockstep"])
    assert not any("rollout/logprob_diff" in m for arm in arms[1:] for m in logged[arm])
    assert [m["offpolicy/version_lag"] for m in logged["off_policy"]] == [0.0, 1.0]
    assert all(m["offpolicy/version_lag"] == 0.0 for arm in arms[:2] for m in logged[arm])
