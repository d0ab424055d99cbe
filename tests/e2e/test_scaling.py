"""`agentgym-mega scaling` on a simulated multi-node Ray cluster: a 2-point sweep over the node
count (1, then 3 raylets on this machine, split placement so the roles spread over them) runs a
short training per point and writes its table, plot and JSON."""

import json
import os
import re

import pytest

from tests.conftest import TINY_TEXTCRAFT, run_cli

pytestmark = pytest.mark.slow


def test_a_two_point_node_sweep_writes_its_table_and_plot(tmp_path, tiny_llama):
    out = tmp_path / "sweep"
    result = run_cli("scaling", "--config", os.path.join("configs", "base.yaml"), "--sweep", "nodes=1,3",
                     "--steps", "2", "--out", str(out), f"model.path={tiny_llama}", *TINY_TEXTCRAFT,
                     "cluster.placement=split", timeout=1200)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads((out / "scaling.json").read_text())
    first, second = report["points"]
    assert report["base"] == 1 and (first["label"], second["label"]) == ("nodes=1", "nodes=3")
    # the trainer's own count of the nodes its roles landed on: 1, then 3 (trainer, engine, env servers)
    assert (first["nodes_used"], second["nodes_used"]) == (1, 3)
    assert first["devices"] == second["devices"] == 2  # one trainer rank, one engine
    for point in (first, second):
        assert point["exit"] == 0 and point["steps"] == 1 and point["first_step"] == 2
        assert point["tokens_per_s"] > 0 and set(point["seconds"]) == {"rollout", "logprob", "train", "sync"}
        assert all(s >= 0 for s in point["seconds"].values()) and point["seconds"]["rollout"] > 0
        assert point["step_s"] == pytest.approx(sum(point["seconds"].values()))
    assert first["efficiency"] == 1.0
    assert second["efficiency"] == pytest.approx(second["tokens_per_s"] / first["tokens_per_s"])
    log = (out / "point-2" / "train.log").read_text()
    assert "simulated Ray cluster: 3 node(s)" in log
    assert re.search(r"placement: 3 node\(s\): trainer ranks on .*, engine workers on .*, env servers on", log)
    table = (out / "scaling.md").read_text()
    assert "| nodes=1 | 2 | 1 | " in table and "| nodes=3 | 2 | 3 | " in table and "| 1.00 |" in table
    assert (out / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert table.split("\n", 2)[2].strip() in result.stdout  # the table is printed, too
