"""SciWorld on ScienceWorld: steps score as ScienceWorld's own step, gold solutions reach 100, one
JVM per instance that close ends, and a dead JVM fails only its own instance."""

import pytest
import requests
from scienceworld import ScienceWorldEnv

import envs
from envs.sciworld import KIND
from envs.sciworld.env import STEP_LIMIT, SciWorldEnv
from envs.sciworld.tasks import EXCLUDED, catalogue
from tests.envs.conftest import running

GOLD_TASKS = ("4-2", "7-1", "6-2", "3-1")  # find-non-living-thing, lifespan, paint mixing, power


def _first(task_id: str) -> int:
    return next(i for i, e in enumerate(catalogue()) if e["task_id"] == task_id)


def test_catalogue_is_flat_task_variation_list_without_the_excluded_types():
    entries = catalogue()
    assert not {e["task_id"] for e in entries} & set(EXCLUDED)
    assert len({e["task_id"] for e in entries}) == 30 - len(EXCLUDED)
    assert entries[0] == {"task": "boil", "task_id": "1-1", "variation": 0, "split": "train"}
    assert {t.split for t in KIND.tasks()} == {"train", "dev", "test"}


@pytest.mark.slow
def test_steps_match_scienceworlds_own_step():
    ours, reference = SciWorldEnv(), ScienceWorldEnv(envStepLimit=STEP_LIMIT)
    try:
        idx = _first("4-2")
        entry = catalogue()[idx]
        gold = ours.gold_actions(idx)
        ours.reset(idx)
        reference.load(entry["task"], entry["variation"], "")
        reference.reset()
        for action in ["look around", "xyzzy", *gold]:
            obs, reward, done, info = reference.step(action)
            mine = ours.step(action)
            assert mine["observation"].startswith(obs)
            assert (mine["reward"], mine["score"], mine["done"]) == (reward, info["score"], done)
    finally:
        ours.close()
        reference.close()


@pytest.mark.slow
def test_gold_action_sequences_reach_score_100():
    env = SciWorldEnv()
    try:
        for task_id in GOLD_TASKS:
            idx = _first(task_id)
            gold = env.gold_actions(idx)
            first = env.reset(idx)
            assert first["observation"].startswith("Task Description:") and first["score"] == 0
            for action in gold:
                result = env.step(action)
            assert result["score"] == 100.0 and result["done"], (task_id, result)
            assert result["episode_score"] == 1.0 and result["success"] is True
    finally:
        env.close()


def test_instruction_names_every_command_form_scienceworld_lists():
    env = SciWorldEnv()
    try:
        env.reset(0)
        forms = set(env._env.get_possible_actions()) - {"reset task"}  # restarting is no move for the model
    finally:
        env.close()
    text = envs.instruction("sciworld")
    # ScienceWorld parses "go to kitchen" as "go OBJ"; its own gold paths say "go to".
    assert sorted(f for f in forms if f.replace("go OBJ", "go to OBJ") not in text) == []


def test_episode_score_and_success_partial_failed_and_reset_fields():
    env = SciWorldEnv()
    try:
        idx = _first("4-2")
        gold = env.gold_actions(idx)
        first = env.reset(idx)
        entry = catalogue()[idx]
        assert (first["task_name"], first["var_num"]) == (entry["task"], entry["variation"])
        assert first["observation"].startswith(first["task_description"])  # AgentGym's client reads both
        partial = [r for r in map(env.step, gold[:-1]) if 0 < r["score"] < 100]
        assert partial and all(r["episode_score"] == r["score"] / 100 and r["success"] is False for r in partial)
        assert all(r["valid_action"] for r in partial)
        env.reset(_first("1-1"))  # boil: focusing on anything but the substance fails the task
        assert env.step("xyzzy")["valid_action"] is False  # ScienceWorld's parser matched no action
        failed = env.step("focus on agent")
        assert failed["done"] and failed["score"] == -100.0 and failed["reward"] == -100.0
        assert failed["valid_action"] is True  # a losing action is still an action
        assert (failed["episode_score"], failed["success"]) == (0.0, False)
    finally:
        env.close()


@pytest.mark.slow
def test_jvms_are_ended_on_close_and_a_dead_jvm_fails_only_its_instance():
    with running("sciworld", "--max-instances", "8") as s:
        post = lambda path, body: requests.post(s.url + path, json=body)  # noqa: E731
        bad = post("/reset", {"id": 0, "data_idx": len(catalogue())})
        assert bad.status_code == 400 and f"from 0 to {len(catalogue()) - 1}" in bad.json()["error"]
        # 20 create/reset/step/close cycles, five instances at a time through /batch.
        pids = set()
        for _ in range(4):
            created = post("/batch", {"ops": [{"op": "create"}] * 5}).json()["results"]
            ids = [r["id"] for r in created]
            pids |= {p.pid for p in s.java_children()}
            resets = post("/batch", {"ops": [{"op": "reset", "id": i, "data_idx": 3236 + i} for i in ids]})
            assert all("Task Description" in r["observation"] for r in resets.json()["results"])
            steps = post("/batch", {"ops": [{"op": "step", "id": i, "action": "look around"} for i in ids]})
            assert all("observation" in r for r in steps.json()["results"])
            assert post("/batch", {"ops": [{"op": "close", "id": i} for i in ids]}).json()["results"] == [
                {"closed": True}] * 5
        assert len(pids) == 20 and s.java_children() == []

        iid = post("/create", {}).json()["id"]
        healthy = post("/create", {}).json()["id"]
        for j in (iid, healthy):
            post("/reset", {"id": j, "data_idx": 3236})
        post("/step", {"id": healthy, "action": "look around"})
        victim = s.java_children()[0]  # one of the two instances' JVMs
        victim_pid = victim.pid
        victim.kill()
        victim.wait(10)
        dead = [post("/step", {"id": j, "action": "look around"}) for j in (iid, healthy)]
        failed = [r for r in dead if r.status_code == 500]
        assert len(failed) == 1 and f"pid {victim_pid}" in failed[0].json()["error"]
        assert sum(r.status_code == 200 for r in dead) == 1
        assert requests.get(f"{s.url}/health").status_code == 200
        bad_text = post("/step", {"id": iid if dead[0].status_code == 200 else healthy, "action": "xyzzy"})
        assert "Valid command forms" in bad_text.json()["observation"]
        for j in (iid, healthy):
            assert post("/close", {"id": j}).json() is True
        assert s.java_children() == []
