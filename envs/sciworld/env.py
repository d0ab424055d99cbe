"""One SciWorld episode in its own ScienceWorld JVM: ScienceWorld's observation text, its 0-100
score, and an end to the JVM on close (the original servers leaked one per instance).

`reward` is the step's score change and `score` the 0-100 score, as AgentGym's; episode_score is
the score / 100 with a failed task's negative score counted as 0; success means the score reached
100 or ScienceWorld flags the task completed (it never does for a failed one). The reset answer
also carries the original's task_description, task_name and var_num; its observation already
starts with the task description, which AgentGym's client prepends once more. A step's valid_action
is False when ScienceWorld's parser matched no action."""

from __future__ import annotations

import os
import subprocess

from py4j.protocol import Py4JError
from scienceworld import ScienceWorldEnv

from envs.environment import InstanceFailed
from envs.sciworld.tasks import catalogue

# The trainer caps turns; ScienceWorld's own default limit (100 moves) would end episodes early.
STEP_LIMIT = 10_000
JVM_EXIT_WAIT_S = 5.0
UNKNOWN_ACTION = "No known action matches that input."
# The JVM otherwise sizes its heap from the machine (a quarter of RAM) and grows to several times
# what a game needs. 256 MiB runs the gold paths of every task type (4 variations each); smaller
# heaps ran out on some tasks (docs/results.md).
# The serial collector keeps 7 fewer threads per JVM. The server's memory cap counts on this.
# Options already in JAVA_TOOL_OPTIONS come after ours, so a user's -Xmx wins (another collector
# would conflict with the serial one: the JVM refuses to start).
JVM_OPTIONS = "-Xmx256m -XX:+UseSerialGC"
os.environ["JAVA_TOOL_OPTIONS"] = f"{JVM_OPTIONS} {os.environ.get('JAVA_TOOL_OPTIONS', '')}".strip()


class SciWorldEnv:
    def __init__(self):
        self._env = ScienceWorldEnv(envStepLimit=STEP_LIMIT)
        self._observation = ""
        self._score = 0
        self._success = False

    @property
    def jvm_pid(self) -> int:
        return self._env._gateway.java_process.pid

    def reset(self, data_idx: int) -> dict:
        entry = catalogue()[data_idx]
        self._call(lambda: self._env.load(entry["task"], entry["variation"], ""))
        obs, info = self._call(self._env.reset)
        self._observation = f"{info['taskDesc']}\n\n{obs}"
        self._score, self._success = int(info["score"]), False
        return {**self._answer(0, False), "task_description": info["taskDesc"],
                "task_name": entry["task"], "var_num": entry["variation"]}

    def step(self, action: str) -> dict:
        obs, score, completed, done = self._call(lambda: self._simulate(action))
        valid = obs.strip() != UNKNOWN_ACTION
        if not valid:
            forms = self._call(self._env.get_possible_actions)
            obs = f"{obs} Valid command forms (OBJ is an object you can see): {', '.join(forms)}."
        reward, self._score = score - self._score, score
        self._success = self._success or score >= 100 or (completed and score >= 0)
        self._observation = obs
        return {**self._answer(reward, done), "valid_action": valid}

    def _answer(self, reward: int, done: bool) -> dict:
        return {"observation": self._observation, "reward": float(reward), "score": float(self._score),
                "done": done, "episode_score": max(self._score, 0) / 100, "success": self._success}

    def _simulate(self, action: str) -> tuple[str, int, bool, bool]:
        """One move, scored as `ScienceWorldEnv.step` scores it: (observation, score, completed,
        done). That method also lists every valid action, the room and the inventory on each
        call, nearly all of a step's time, for information the protocol does not return."""
        sim = self._env.server
        obs = sim.step(action)
        score = int(round(100 * sim.getScore()))
        completed = bool(sim.getCompleted())
        done = completed or score < 0 or self._env.get_num_moves() > STEP_LIMIT
        return obs, score, completed, done

    def gold_actions(self, data_idx: int) -> list[str]:
        """ScienceWorld's own solution of a task (reloads it; reset before playing)."""
        entry = catalogue()[data_idx]
        self._call(lambda: self._env.load(entry["task"], entry["variation"], "", generateGoldPath=True))
        return list(self._call(self._env.get_gold_action_sequence))

    def observation(self) -> str:
        return self._observation

    def close(self) -> None:
        """Shuts the gateway and waits for the JVM to exit, killing it if it does not."""
        proc = self._env._gateway.java_process
        try:
            self._env.close()
        except Exception:  # a JVM that already died cannot take the shutdown message
            pass
        try:
            proc.wait(timeout=JVM_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _call(self, fn):
        try:
            return fn()
        except Py4JError as exc:
            code = self._env._gateway.java_process.poll()
            if code is not None:
                raise InstanceFailed(f"the ScienceWorld JVM (pid {self.jvm_pid}) exited with code {code}") from None
            raise InstanceFailed(f"ScienceWorld failed: {exc}") from None
