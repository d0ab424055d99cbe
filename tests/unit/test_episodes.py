"""Saved episodes (agentgym_mega.episodes): which are kept, the line format, whole-file writes that
a resumed step replaces, and the size cap."""

import json

from agentgym_mega.config import EpisodesConfig
from agentgym_mega.episodes import EpisodeWriter, episode_line
from agentgym_mega.rollout.batch import Episode
from agentgym_mega.rollout.manager import _transcribe
from agentgym_mega.rollout.status import Status


def _episode(task_id: int, turns: int = 2, sample: int = 0) -> Episode:
    record = {"observation": f"task {task_id}", "weight_version": 3, "sample": sample,
              "tokens": {"prompt": 10, "response": 4 * turns, "total": 10 + 9 * turns}, "time_s": 0.5, "turns": []}
    for i in range(turns):
        turn = {"text": f"Thought: t{i}\nAction: go forward", "tokens": 4, "generate_s": 0.01}
        _transcribe(turn, {"observation": f"obs {i}", "reward": 0.5 * i, "done": False, "valid_action": True,
                           "action": "go forward"}, 0.002)
        record["turns"].append(turn)
    return Episode(task_id, "GoToRedBall", task_id // 10, 0.5, True, turns, Status.DONE, 4 * turns,
                   transcript=record)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_line_holds_identity_outcome_and_turns():
    line = episode_line(_episode(12, sample=1), step=3, split="eval", env="babyai")
    assert {k: line[k] for k in ("step", "split", "env", "task_id", "category", "group", "sample", "weight_version",
                                 "status", "score", "success", "error")} == {
        "step": 3, "split": "eval", "env": "babyai", "task_id": 12, "category": "GoToRedBall", "group": 1,
        "sample": 1, "weight_version": 3, "status": "done", "score": 0.5, "success": True, "error": None}
    assert line["rewards"] == [0.0, 0.5] and line["observation"] == "task 12" and line["time_s"] == 0.5
    assert line["turns"][1] == {"text": "Thought: t1\nAction: go forward", "tokens": 4, "generate_s": 0.01,
                                "action": "go forward", "valid_action": True, "action_error": None,
                                "observation": "obs 1", "reward": 0.5, "observation_tokens": 0, "env_s": 0.002}
    json.dumps(line)  # plain JSON: no enum, no tensor


def test_why_a_reply_was_no_action():
    none, wrong, broken = {}, {}, {}
    _transcribe(none, {"observation": "?", "reward": 0, "done": False, "valid_action": False, "action": ""}, 0.1)
    _transcribe(wrong, {"observation": "?", "reward": 0, "done": False, "valid_action": False, "action": "fly"}, 0.1)
    _transcribe(broken, {"error": "server gone", "status": 502}, 0.1)
    assert none["action_error"] == "no action in the reply"
    assert wrong["action_error"] == "not an action this environment accepts" and wrong["action"] == "fly"
    assert broken["action_error"] == "env error: server gone" and broken["observation"] is None


def test_which_episodes_are_kept(tmp_path):
    writer = EpisodeWriter(str(tmp_path), EpisodesConfig(train_every=2, train_per_step=3), "babyai")
    batch = [_episode(i) for i in range(8)]
    for step in (1, 2):
        writer.add(step, "train", batch)
        writer.add(step, "eval", batch[:5])
        writer.flush(step)
    writer.close()
    assert sorted(p.name for p in (tmp_path / "episodes").iterdir()) == ["step_1.jsonl", "step_2.jsonl"]
    step1, step2 = _lines(tmp_path / "episodes" / "step_1.jsonl"), _lines(tmp_path / "episodes" / "step_2.jsonl")
    assert [(e["split"], e["task_id"]) for e in step1] == [("eval", i) for i in range(5)]  # step 1 is no 2nd step
    assert [(e["split"], e["task_id"]) for e in step2] == [("train", i) for i in range(3)] + [
        ("eval", i) for i in range(5)]
    assert writer.write_s > 0

    quiet = EpisodeWriter(str(tmp_path / "quiet"), EpisodesConfig(eval=False, train_every=0), "babyai")
    quiet.add(1, "train", batch)
    quiet.add(1, "eval", batch)
    quiet.flush(1)
    quiet.close()
    assert not (tmp_path / "quiet" / "episodes").exists()


def test_a_redone_step_replaces_its_file(tmp_path):
    """A resumed run redoes the steps after its checkpoint: their files are rewritten whole, never
    appended to, and no temporary file is left beside them."""
    for task in (1, 2):  # the first run, then the resumed one redoing step 5
        writer = EpisodeWriter(str(tmp_path), EpisodesConfig(), "babyai")
        writer.add(5, "train", [_episode(task), _episode(task)])
        writer.flush(5)
        writer.close()
    assert [e["task_id"] for e in _lines(tmp_path / "episodes" / "step_5.jsonl")] == [2, 2]
    assert [p.name for p in (tmp_path / "episodes").iterdir()] == ["step_5.jsonl"]


def test_the_size_cap_stops_writing_with_one_warning(tmp_path, capsys):
    size = len(json.dumps(episode_line(_episode(1), 1, "train", "babyai"))) + 1
    cap_mb = 2.5 * size / 1e6  # room for two one-episode steps, not three
    writer = EpisodeWriter(str(tmp_path), EpisodesConfig(max_mb=cap_mb), "babyai")
    for step in (1, 2, 3, 4):
        writer.add(step, "train", [_episode(1)])
        writer.flush(step)
    writer.close()
    assert sorted(p.name for p in (tmp_path / "episodes").iterdir()) == ["step_1.jsonl", "step_2.jsonl"]
    warnings = [line for line in capsys.readouterr().err.splitlines() if "max_mb" in line]
    assert len(warnings) == 1 and "from step 3 on" in warnings[0]
    # a resumed run counts what is there already: still no room
    again = EpisodeWriter(str(tmp_path), EpisodesConfig(max_mb=cap_mb), "babyai")
    again.add(3, "train", [_episode(1)])
    again.close()
    assert not (tmp_path / "episodes" / "step_3.jsonl").exists()
