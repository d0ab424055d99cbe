"""`agentgym-mega scaling`: sweep points, a point's figures from a hand-written metrics.jsonl
(means after the warm-up, tokens/s, speedup and efficiency worked out by hand), the report files,
the projection's FLOP count and phases checked against hand arithmetic, and the CLI's refusals."""

import json
import os

import pytest

from agentgym_mega import memory_formulas as mf
from agentgym_mega import memory_plan as mp
from agentgym_mega.cli import main
from agentgym_mega.config import load_config
from agentgym_mega.errors import BadInput
from agentgym_mega.scaling import projection, report, sweep
from agentgym_mega.scaling.assumptions import Hardware, Workload
from tests.conftest import REPO
from tests.unit.test_memory_plan import LAYER_TP1, SMALL, architecture

RECIPE_7B = os.path.join(REPO, "configs", "recipes", "textcraft_qwen2.5-7b.yaml")
BASE = os.path.join(REPO, "configs", "base.yaml")


def test_sweep_values_keep_bracketed_lists_whole():
    assert sweep.split_values("1,2, 4") == ["1", "2", "4"]
    assert sweep.split_values("[depth-1],[depth-1,depth-2]") == ["[depth-1]", "[depth-1,depth-2]"]
    assert sweep.split_values("{a: 1, b: 2},x") == ["{a: 1, b: 2}", "x"]


def test_sweeps_move_together_and_nodes_is_not_an_override():
    points = sweep.points(["nodes=1,2", "parallel.world_size=2,4"])
    assert [p.index for p in points] == [1, 2]
    assert [p.nodes for p in points] == [1, 2]
    assert points[1].overrides == ["parallel.world_size=4"]
    assert points[1].label == "nodes=2 parallel.world_size=4"
    assert sweep.points(["trainer.batch_size=2,4"])[0].nodes is None
    overrides = sweep.point_overrides(points[1], ["trainer.seed=3"], 5, "/out")
    assert overrides[:2] == ["trainer.seed=3", "parallel.world_size=4"]
    assert "trainer.total_steps=5" in overrides and "trainer.output_dir=/out/point-2" in overrides
    assert "eval.freq=0" in overrides


@pytest.mark.parametrize("sweeps, message", [
    ([], "at least one"),
    (["parallel.world_size"], "expected key=v1,v2"),
    (["parallel.world_size=1,,2"], "expected key=v1,v2"),
    (["nodes=1,two"], "integers >= 1"),
    (["nodes=0,1"], "integers >= 1"),
    (["nodes=1,2", "nodes=3,4"], "given twice"),
    (["nodes=1,2", "trainer.batch_size=2,4,8"], "as many values"),
])
def test_bad_sweeps_are_named(sweeps, message):
    with pytest.raises(BadInput, match=message):
        sweep.points(sweeps)


def test_every_point_is_checked_before_anything_runs(tmp_path, tiny_qwen2):
    common = [f"model.path={tiny_qwen2}"]
    points = sweep.points(["trainer.batch_size=16,no"])
    with pytest.raises(BadInput, match=r"point 2 \(trainer.batch_size=no\)"):
        sweep.check(BASE, common, points, 2, str(tmp_path), "local", joining=False)
    with pytest.raises(BadInput, match="no config.json"):
        sweep.check(BASE, [f"model.path={tmp_path}"], sweep.points(["trainer.seed=1"]), 2, str(tmp_path), "local",
                    joining=False)
    with pytest.raises(BadInput, match="cannot change its node count"):
        sweep.check(BASE, common, sweep.points(["nodes=1,2"]), 2, str(tmp_path), "local", joining=True)
    (tmp_path / "point-1").mkdir()
    (tmp_path / "point-1" / "metrics.jsonl").write_text("")
    with pytest.raises(BadInput, match="holds an earlier sweep"):
        sweep.check(BASE, common, sweep.points(["trainer.seed=1"]), 2, str(tmp_path), "local", joining=False)


def test_a_slurm_point_is_one_waited_job_with_its_node_count():
    point = sweep.points(["nodes=4"])[0]
    command = sweep.sbatch_command(point, "configs/base.yaml", ["trainer.seed=1"], "/out/point-1", ["--partition=gpu"])
    assert command[:3] == ["sbatch", "--wait", "--nodes=4"]
    assert "--output=/out/point-1/slurm-%j.out" in command and "--partition=gpu" in command
    assert command[-3:] == [sweep.SLURM_SCRIPT, os.path.abspath("configs/base.yaml"), "trainer.seed=1"]


def _step(step, rollout, logprob, train, sync, tokens, values=None, nodes=2):
    record = {"step": step, "time/rollout_s": rollout, "time/logprob_s": logprob, "time/train_s": train,
              "time/sync_s": sync, "perf/tokens": tokens, "perf/tokens_per_s": 1.0, "cluster/nodes": nodes}
    if values is not None:
        record["time/values_s"] = values
    return record


def write_metrics(run_dir, records):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def test_a_point_is_the_mean_of_its_steps_after_the_warm_up(tmp_path):
    write_metrics(tmp_path, [
        {"step": 0, "eval/success": 0.5},  # evaluation only: not a step
        _step(1, 50.0, 9.0, 9.0, 9.0, 10),  # warm-up: left out
        _step(2, 1.0, 1.0, 1.0, 1.0, 1),  # rewritten by a resumed run below
        _step(2, 4.0, 1.0, 3.0, 1.0, 1000, values=1.0),
        _step(3, 6.0, 1.0, 2.0, 1.0, 1400),
    ])
    figures = report.summarize(str(tmp_path), warmup=1)
    # rollout (4+6)/2; log-probs ((1+1)+1)/2; train (3+2)/2; sync 1: a step of 10 s, 1200 tokens.
    assert figures["seconds"] == {"rollout": 5.0, "logprob": 1.5, "train": 2.5, "sync": 1.0}
    assert figures["step_s"] == 10.0 and figures["tokens_per_step"] == 1200
    assert figures["tokens_per_s"] == 120.0
    assert (figures["steps"], figures["first_step"], figures["nodes_used"]) == (2, 2, 2)
    assert "no step after the first 3" in report.summarize(str(tmp_path), warmup=3)["error"]
    assert "0 step(s) logged" in report.summarize(str(tmp_path / "missing"), warmup=1)["error"]


def test_efficiency_is_speedup_over_the_devices_ratio_against_the_first_point_with_figures(tmp_path):
    rows = [
        {"index": 1, "label": "a", "devices": 2, "exit": 3, "log": "p1.log", "error": "none"},
        {"index": 2, "label": "b", "devices": 2, "exit": 0, "tokens_per_s": 120.0},
        {"index": 3, "label": "c", "devices": 4, "exit": 0, "tokens_per_s": 180.0},
    ]
    for row in rows[1:]:
        row |= {"seconds": dict.fromkeys(report.PHASES, 1.0), "step_s": 4.0, "tokens_per_step": 480.0}
    built = report.build(rows)
    assert built["base"] == 2
    assert "speedup" not in rows[0]
    assert (rows[1]["speedup"], rows[1]["efficiency"]) == (1.0, 1.0)
    assert (rows[2]["speedup"], rows[2]["efficiency"]) == (1.5, 0.75)
    text = report.table(built)
    assert "| a | 2 | - | failed (exit 3, p1.log) |" in text
    assert "| c | 4 | - | 1.00 | 1.00 | 1.00 | 1.00 | 4.00 | 480 | 180 | 1.50 | 0.75 |" in text
    paths = report.write(built, str(tmp_path), "title")
    assert json.loads(open(paths["json"]).read())["points"][2]["efficiency"] == 0.75
    assert open(paths["table"]).read().startswith("# title\n")
    assert open(paths["plot"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "none").mkdir()
    assert "plot" not in report.write(report.build([rows[0]]), str(tmp_path / "none"), "t")


def test_forward_flops_count_every_matrix_and_the_attention_by_hand():
    a = mf.Arch.of(SMALL)
    matrices = LAYER_TP1 - 2 * 128 - 256  # the layer less its norms and QKV bias: 147456
    assert mf.forward_flops_per_token(a, 0) == 2 * (2 * matrices + 300 * 128)
    assert mf.forward_flops_per_token(a, 100) - mf.forward_flops_per_token(a, 0) == 4 * 2 * 100 * 128
    # Qwen2.5-7B: every weight but the embedding lookup, the norms and the QKV biases, twice.
    q7 = mf.Arch.of(architecture("qwen2.5-7b-instruct"))
    weights = mf.total_params(q7) - 152064 * 3584 - (2 * 28 + 1) * 3584 - 28 * (28 + 8) * 128
    assert weights == 7_070_285_824
    assert mf.forward_flops_per_token(q7, 0) == 2 * weights


def _project_7b(nodes=(1, 2), **hardware):
    cfg = load_config(RECIPE_7B)
    hf = mp.read_architecture(cfg.model)[0]
    return projection.project([(RECIPE_7B, cfg, hf)], list(nodes), Hardware(**hardware), Workload())


def test_projection_phases_by_hand_for_7b_on_one_node():
    row = _project_7b()["rows"][0]
    assert (row["tp"], row["pp"], row["dp"], row["gpus"], row["transport"]) == (4, 1, 2, 8, "cuda_ipc")
    cfg = load_config(RECIPE_7B)
    episodes = cfg.trainer.batch_size * cfg.rollout.n_per_task
    assert row["tokens_per_step"] == episodes * 8192
    # log-probs: actor and reference, one forward of every token at mean context 4096, PP=1.
    fwd = 2 * 7_070_285_824 + 4 * 28 * 4096 * 3584
    assert row["seconds"]["logprob"] == pytest.approx(2 * episodes * 8192 * fwd / (8 * 989e12 * 0.40), rel=1e-12)
    # sync by CUDA IPC: the TP gather of 3/4 of the bf16 weights over NVLink, then one HBM copy.
    weights = 7_615_616_512 * 2
    assert row["seconds"]["sync"] == pytest.approx(weights * 3 / 4 / 450e9 + weights / (3.35e12 * 0.7), rel=1e-12)
    assert row["step_s"] == pytest.approx(sum(row["seconds"].values()))
    assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["step_s"])


def test_projection_scales_by_data_parallelism_and_follows_its_rates():
    one, two = _project_7b()["rows"]
    # colocated over two nodes: each rank feeds the engine on its GPU, no weight crosses the network
    assert (two["dp"], two["engines"], two["gpus"], two["transport"]) == (4, 16, 16, "cuda_ipc")
    assert two["seconds"]["sync"] == one["seconds"]["sync"]
    assert two["seconds"]["logprob"] == pytest.approx(one["seconds"]["logprob"] / 2)
    assert (one["efficiency"], two["efficiency"]) == (1.0, pytest.approx(two["speedup"] / 2))
    faster = _project_7b(peak_tflops=2 * 989.0)["rows"][0]
    assert faster["seconds"]["logprob"] == pytest.approx(one["seconds"]["logprob"] / 2)
    assert faster["seconds"]["sync"] == one["seconds"]["sync"]
    wider = _project_7b(nodes=(2,), network_gbps=100.0)["rows"][0]
    assert wider["seconds"]["logprob"] == two["seconds"]["logprob"]
    assert wider["seconds"]["sync"] == two["seconds"]["sync"]  # PP=1: every stage is on the rank


def test_a_pipeline_over_nodes_broadcasts_the_other_stages_over_the_network():
    seventy_b = os.path.join(REPO, "configs", "recipes", "textcraft_llama-3.1-70b.yaml")
    rows = [projection.estimate(load_config(seventy_b), mp.read_architecture(load_config(seventy_b).model)[0], 8,
                                Hardware(network_gbps=gbps), Workload()) for gbps in (50.0, 100.0)]
    assert rows[0]["transport"] == "cuda_ipc" and rows[0]["pp"] == 4
    # the three other stages' share (3/4 of the bf16 weights) over the network: twice the link, half the time
    weights = mf.total_params(mf.Arch.of(mp.read_architecture(load_config(seventy_b).model)[0])) * 2
    assert rows[0]["seconds"]["sync"] - rows[1]["seconds"]["sync"] == pytest.approx(
        weights * 3 / 4 * (1 / 50e9 - 1 / 100e9), rel=1e-9)


def test_a_node_count_the_recipe_cannot_use_is_named_and_the_first_that_fits_is_the_base():
    result = projection.project(
        [(p, load_config(p), mp.read_architecture(load_config(p).model)[0])
         for p in (os.path.join(REPO, "configs", "recipes", "textcraft_llama-3.1-70b.yaml"),)],
        [1, 4, 8, 16], Hardware(), Workload())
    rows = result["rows"]
    assert "error" in rows[0] and "world_size=8" in rows[0]["error"]
    # 4 nodes (DP=1) fit the GPUs and a node's 512 GB of host memory (446 GB: no rollback copies)
    assert rows[1].get("error") is None
    assert (rows[1]["nodes"], rows[1]["efficiency"]) == (4, 1.0)
    assert rows[2]["efficiency"] == pytest.approx(rows[2]["speedup"] / 2)
    text = projection.table(result)
    assert text.startswith("ESTIMATE, not a measurement")
    assert "| textcraft_llama-3.1-70b | 1 | " in text


def test_a_share_above_one_is_refused(capsys):
    with pytest.raises(BadInput, match="mfu=1.5 is a share"):
        Hardware(mfu=1.5)
    assert main(["scaling", "--project", "--hbm-efficiency", "2"]) == 2
    assert "hbm_efficiency=2.0 is a share" in capsys.readouterr().err


def test_cli_projection_and_its_json(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["scaling", "--project", "--config", RECIPE_7B, "--nodes", "1,2", "--mfu", "0.5",
                 "--json", str(out)]) == 0
    assert "ESTIMATE" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["estimate"] is True and result["hardware"]["mfu"] == 0.5
    assert [r["nodes"] for r in result["rows"]] == [1, 2]


@pytest.mark.parametrize("args, message", [
    (["--config", BASE, "--sweep", "trainer.seed=1,2", "--steps", "2", "--warmup", "2"], "no step would be measured"),
    (["--config", BASE, "--config", BASE, "--sweep", "trainer.seed=1"], "exactly one config"),
    (["--sweep", "trainer.seed=1"], "exactly one config"),
    (["--config", BASE, "--sweep", "nodes=1,x"], "integers >= 1"),
])
def test_cli_refusals_exit_2(args, message, capsys, tmp_path):
    assert main(["scaling", "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_report_only_reports_an_existing_sweep_and_fails_a_point_without_figures(tmp_path, capsys,
                                                                                      tiny_qwen2):
    write_metrics(tmp_path / "point-1", [_step(1, 9, 9, 9, 9, 10, nodes=1), _step(2, 2, 1, 1, 0, 500, nodes=1)])
    write_metrics(tmp_path / "point-2", [_step(1, 9, 9, 9, 9, 10, nodes=3), _step(2, 2, 1, 1, 0, 900, nodes=3)])
    args = ["scaling", "--config", BASE, "--sweep", "nodes=1,3", "--steps", "2", "--out", str(tmp_path),
            "--report-only", f"model.path={tiny_qwen2}"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "| nodes=3 | " in text and "| 1.80 | " in text  # 900 over 500 tokens/s on the same devices
    assert os.path.isfile(tmp_path / "scaling.png")
    (tmp_path / "point-2" / "metrics.jsonl").unlink()
    assert main(args) == 1
    assert "no figures for 1 point(s): nodes=3" in capsys.readouterr().err
