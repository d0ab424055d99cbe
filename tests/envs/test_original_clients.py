"""AgentGym's own clients against our servers, unchanged. Each client below behaves as the original
`agentenv` client of its environment does on the wire: the request bodies it sends, the answer
fields it reads, and the status it insists on (anything but 200 is an error to it)."""

import json
import re

import requests

from envs.textcraft.game import TextCraftEnv
from tests.envs.conftest import running


class _OriginalClient:
    def __init__(self, url: str, create_body: dict | None = None):
        self.url = url
        resp = requests.post(f"{url}/create", json=create_body, timeout=300)
        assert resp.status_code == 200, resp.text
        self.created = resp.json()
        self.env_id = self.created["id"]

    def _post(self, path: str, data: dict) -> dict:
        data["id"] = self.env_id
        resp = requests.post(f"{self.url}/{path}", json=data, timeout=300)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def _step(self, action: str) -> dict:
        out = self._post("step", {"action": action})
        return {k: out[k] for k in self.step_fields}

    def reset(self, data_idx: int) -> dict:
        return self._post("reset", {"data_idx": data_idx})


class OriginalTextCraftClient(_OriginalClient):
    """Sends {"minecraft_dir", "commands", "goal"} to /create and reads the first observation from
    its answer; cleans the reply's Action line itself and sends only the command."""

    step_fields = ("observation", "reward", "done")

    def __init__(self, url: str):
        super().__init__(url, {"minecraft_dir": "agentenv_textcraft/", "commands": None, "goal": None})
        self.observation = self.created["observation"]

    def step(self, reply: str) -> dict:
        found = re.findall(r"Action:\s*(.*?)(?=\n|$)", reply, re.DOTALL)
        if len(found) > 1:
            raise AssertionError("the original refuses replies with two Action lines before sending")
        command = " ".join(re.sub(r"[^A-Za-z0-9, ]+", "", found[-1] if found else "").split())
        return self._step("inventory" if command.lower() == "look" else command)

    def reset(self, data_idx: int) -> dict:
        out = super().reset(data_idx)
        self.observation = out["observation"]
        return out

    def close(self):
        return self._post("close", {})


class OriginalBabyAIClient(_OriginalClient):
    """Creates without a body; sends the text after "Action:"; reads score beside reward."""

    step_fields = ("observation", "reward", "score", "done")

    def step(self, reply: str) -> dict:
        parts = reply.split("Action:")
        return self._step((parts[1] if len(parts) > 1 else parts[0]).strip())

    def reset(self, data_idx: int) -> dict:
        out = super().reset(data_idx)
        self.info = {k: out[k] for k in ("observation", "reward", "score", "done")}
        return out


class OriginalSciWorldClient(OriginalBabyAIClient):
    """As BabyAI's, but its reset reads task_description and puts it before the observation."""

    def reset(self, data_idx: int) -> dict:
        out = self._post("reset", {"data_idx": data_idx})
        self.observation = out["task_description"] + "\n" + out["observation"]
        return out


def test_original_textcraft_client(textcraft_server):
    client = OriginalTextCraftClient(textcraft_server.url)
    # As the original server did, /create with a body starts the episode data_idx = id.
    assert client.observation == TextCraftEnv().reset(client.env_id)["observation"]
    assert client.created["reward"] == 0 and client.created["done"] is False
    client.reset(0)  # acacia planks from acacia logs
    assert client.observation.startswith("Crafting commands:") and "Goal: craft acacia planks." in client.observation
    got = client.step("Thought: I need logs.\nAction: get 1 acacia logs")
    assert got == {"observation": "Got 1 acacia logs", "reward": 0.0, "done": False}
    assert client.step("Thought: check.\nAction: look.")["observation"] == "Inventory: [acacia logs] (1) "
    won = client.step("Thought: craft it.\nAction: craft 4 acacia planks using 1 acacia logs")
    assert won == {"observation": "Crafted 4 minecraft:acacia_planks", "reward": 1.0, "done": True}
    assert client.close() is True


def test_textcraft_create_bodies_the_original_server_took_and_one_it_did_not(textcraft_server):
    url = textcraft_server.url
    assert "observation" not in requests.post(f"{url}/create").json()  # no body: ours, just an id
    custom = requests.post(f"{url}/create", json={"commands": "craft 1 x using 1 y", "goal": "minecraft:x"})
    assert custom.status_code == 400 and "custom task" in custom.json()["error"]
    unknown = requests.post(f"{url}/create", json={"seed": 3})
    assert unknown.status_code == 400 and "allowed: minecraft_dir, commands, goal" in unknown.json()["error"]


def test_original_babyai_client(babyai_server):
    client = OriginalBabyAIClient(babyai_server.url)
    assert set(client.created) == {"id"}
    client.reset(1)  # level 2, GoToRedBall, seed 0
    assert client.info["observation"].startswith("Your goal: go to the red ball") and client.info["done"] is False
    actions = json.loads(client.info["observation"].split("Available actions: ", 1)[1])
    target = next((a for a in actions if a.startswith("go to red ball")), "turn left")
    out = client.step(f"Thought: The ball is in sight.\nAction: {target}")
    assert isinstance(out["observation"], str) and out["score"] == out["reward"]
    assert out["done"] == (out["reward"] > 0)  # going to the ball wins; a turn does not
    nope = requests.post(f"{babyai_server.url}/create", json={"level": 3})
    assert nope.status_code == 400 and "/create takes no fields" in nope.json()["error"]


def test_original_sciworld_client():
    with running("sciworld", "--max-instances", "2") as server:
        client = OriginalSciWorldClient(server.url)
        out = client.reset(0)
        assert client.observation.startswith("Task Description:") and "This room is called" in client.observation
        assert (out["task_name"], out["var_num"], out["score"], out["done"]) == ("boil", 0, 0.0, False)
        step = client.step("Thought: Where am I?\nAction: look around")
        assert step["observation"].startswith("This room is called the") and step["done"] is False
        assert (step["reward"], step["score"]) == (0.0, 0.0)


class OriginalSearchQAClient:
    """AgentGym's searchqa client as its dialect goes on the wire: /create {"id": 0} answers a bare
    integer; every later request carries it as env_idx (the task of a reset as `id`); the whole
    model reply is the action; it reads observation, reward and done."""

    def __init__(self, url: str):
        self.url = url
        resp = requests.post(f"{url}/create", json={"id": 0}, timeout=300)
        assert resp.status_code == 200, resp.text
        self.env_id = resp.json()

    def _post(self, path: str, data: dict):
        data["env_idx"] = self.env_id
        resp = requests.post(f"{self.url}/{path}", json=data, timeout=300)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def observe(self):
        resp = requests.get(f"{self.url}/observation?env_idx={self.env_id}", timeout=300)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def step(self, reply: str) -> dict:
        out = self._post("step", {"action": reply})
        return {k: out[k] for k in ("observation", "reward", "done")}

    def reset(self, task: int):
        return self._post("reset", {"id": task})

    def close(self):
        return self._post("close", {})


class OriginalWebArenaClient(OriginalSearchQAClient):
    """AgentGym's webarena client, the same dialect with its own ends: /create with no body answers
    {"env_idx"}; a reset sends `{"env_idx", "seed": 0, "idx"}` and raises on the observation
    "TimeoutError"; a step sends the whole model reply and reads observation, reward and
    terminated, the reward counting only when terminated (driven in tests/envs/test_webarena.py)."""

    def __init__(self, url: str):
        self.url = url
        resp = requests.post(f"{url}/create", timeout=300)
        assert resp.status_code == 200, resp.text
        self.env_id = resp.json()["env_idx"]

    def step(self, reply: str) -> dict:
        out = self._post("step", {"action": reply})
        return {"state": out["observation"], "reward": out["reward"] if out["terminated"] else 0,
                "done": out["terminated"]}

    def reset(self, idx: int) -> dict:
        out = self._post("reset", {"seed": 0, "idx": idx})
        if out["observation"] == "TimeoutError":
            raise TimeoutError(f"reset of task {idx} timed out")
        return out


def test_original_searchqa_client():
    from envs.deepsearch import options, tasks

    questions = tasks.load(options.DATA_DIR)
    with running("deepsearch", "--max-instances", "4") as server:
        client = OriginalSearchQAClient(server.url)
        assert isinstance(client.env_id, int) and not isinstance(client.env_id, bool)
        assert client.observe() == f"Question: {questions[0].question}"  # /create started task 0
        client.reset(7)
        assert client.observe() == f"Question: {questions[7].question}"
        found = client.step(f"<think>Look it up.</think>\n<search>{questions[7].question}</search>")
        assert found["observation"].startswith("<information>Doc 1(Title: ") and found["done"] is False
        wrong = client.step("<think>A guess.</think>\n<answer>surely not this</answer>")
        assert (wrong["reward"], wrong["done"]) == (0.0, False)
        right = client.step(f"<think>Found it.</think>\n<answer>{questions[7].golden_answers[0]}</answer>")
        assert (right["reward"], right["done"]) == (1.0, True)
        assert client.close() is True
        # Ours beside it on the same server: /create without a body answers {"id"} (and env_idx, which
        # WebArena's client of the same dialect reads).
        created = requests.post(f"{server.url}/create", timeout=60).json()
        assert set(created) == {"id", "env_idx"} and created["id"] == created["env_idx"]
        nope = requests.post(f"{server.url}/create", json={"id": len(questions)}, timeout=60)
        assert nope.status_code == 400 and "is not allowed" in nope.json()["error"]
