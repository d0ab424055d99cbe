"""One SciWorld episode in its own ScienceWorld JVM: ScienceWorld's observation text, its 0-100
score, and an end to the JVM on close (the original servers leaked one per instance)."""

from __future__ import annotations

import subprocess

from py4j.protocol import Py4JError
from scienceworld import ScienceWorldEnv

from envs.environment import InstanceFailed
from envs.sciworld.tasks import catalogue

# The trainer caps turns; ScienceWorld's own default limit (100 moves) would end episodes early.
STEP_LIMIT = 10_000
JVM_EXIT_WAIT_S = 5.0
UNKNOWN_ACTION = "No known action matches that input."


class SciWorldEnv:
    def __init__(self):
        self._env = ScienceWorldEnv(envStepLimit=STEP_LIMIT)
        self._observation = ""
        self._score = 0

    @property
    def jvm_pid(self) -> int:
        return self._env._gateway.java_process.pid

    def reset(self, data_idx: int) -> dict:
        entry = catalogue()[data_idx]
        self._call(lambda: self._env.load(entry["task"], entry["variation"], ""))
        obs, info = self._call(self._env.reset)
        self._observation = f"{info['taskDesc']}\n\n{obs}"
        self._score = int(info["score"])
        return {"observation": self._observation, "reward": 0.0, "score": float(self._score), "done": False}

    def step(self, action: str) -> dict:
        obs, score, done = self._call(lambda: self._simulate(action))
        if obs.strip() == UNKNOWN_ACTION:
            forms = self._call(self._env.get_possible_actions)
            obs = f"{obs} Valid command forms (OBJ is an object you can see): {', '.join(forms)}."
        reward, self._score = score - self._score, score
        self._observation = obs
        return {"observation": obs, "reward": float(reward), "score": float(score), "done": done}

    def _simulate(self, action: str) -> tuple[str, int, bool]:
        """One move, scored as `ScienceWorldEnv.step` scores it. That method also lists every
        valid action, the room and the inventory on each call: 0.24 s of a 0.25 s step here,
        for information the protocol does not return."""
        sim = self._env.server
        obs = sim.step(action)
        score = int(round(100 * sim.getScore()))
        done = bool(sim.getCompleted()) or score < 0 or self._env.get_num_moves() > STEP_LIMIT
        return obs, score, done

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
