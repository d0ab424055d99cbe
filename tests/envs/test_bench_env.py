"""`agentgym-mega bench env` runs both paths against a real server and writes its report."""

import json

from tests.conftest import run_cli


def _bench(tmp_path, env: str, concurrency: str) -> dict:
    out = tmp_path / "bench.json"
    result = run_cli("bench", "env", "--env", env, "--concurrency", concurrency, "--steps", "3",
                     "--json", str(out), timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(out.read_text())


def test_bench_env_writes_both_paths_and_rss(tmp_path):
    report = _bench(tmp_path, "textcraft", "1,4")
    rows = {(r["concurrency"], r["path"]): r for r in report["results"]}
    assert set(rows) == {(1, "per_request"), (1, "batched"), (4, "per_request"), (4, "batched")}
    for (c, _), row in rows.items():
        assert row["steps"] == 3 * c and row["errors"] == 0
        assert row["steps_per_s"] > 0 and 0 < row["step_latency_p50_ms"] <= row["step_latency_p99_ms"]
    assert report["server_rss_before_bytes"] > 0 and report["server_rss_after_bytes"] > 0
    assert set(report["batched_over_per_request"]) == {"1", "4"}


def test_bench_env_deepsearch_reports_the_retrievers_rates_beside_the_steps(tmp_path):
    from envs.deepsearch import options, tasks

    report = _bench(tmp_path, "deepsearch", "2")
    assert [(r["path"], r["steps"], r["errors"]) for r in report["results"]] == [("per_request", 6, 0),
                                                                                 ("batched", 6, 0)]
    rates = report["retriever"]
    assert rates["queries"] == len(tasks.load(options.DATA_DIR))
    assert rates["batched_qps"] > 0 and rates["single_qps"] > 0
    assert 0 < rates["single_p50_ms"] <= rates["single_p99_ms"]


def test_bench_env_webarena_measures_what_a_live_context_costs(tmp_path):
    report = _bench(tmp_path, "webarena", "2")
    assert [(r["path"], r["steps"], r["errors"]) for r in report["results"]] == [("per_request", 6, 0),
                                                                                 ("batched", 6, 0)]
    memory = report["memory_per_instance"]
    assert memory["instances"] == 2 and memory["errors"] == 0
    assert memory["live"]["pss_bytes"] > memory["idle"]["pss_bytes"] > 0
    assert 0 < memory["per_instance_pss_bytes"] <= memory["per_instance_rss_bytes"]
