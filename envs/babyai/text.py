"""BabyAI in text, on minigrid: the observation (goal, visible objects with positions relative
to the agent, walls, what it carries, available actions) and high-level actions (`go to red
ball 1`, `pickup grey key 1`, `toggle and go through red closed door 1`) expanded into primitive
moves by breadth-first search over the grid. Rewards are minigrid's own (1 - 0.9 * steps /
max_steps on success), summed over the primitive moves an action expands to.

episode_score is that success reward once the mission is accomplished, else 0; success means the
episode ended with a positive reward (minigrid's success, not a failed or timed-out mission).
A step's valid_action says whether the command had one of the command forms."""

from __future__ import annotations

import collections
import json

from minigrid.core.actions import Actions
from minigrid.core.constants import DIR_TO_VEC

from envs.babyai import levels

PRIMITIVES = {
    "turn left": Actions.left, "turn right": Actions.right, "move forward": Actions.forward,
    "pickup": Actions.pickup, "pick up": Actions.pickup, "drop": Actions.drop, "toggle": Actions.toggle,
}
CHECK = "check available actions"
# Longest prefixes first: "toggle and go through" must not be read as "toggle".
HIGH_LEVEL = ("toggle and go through ", "go through ", "go to ", "pickup ", "pick up ")
COMMAND_FORMS = ("turn left", "turn right", "move forward", "go to <object>", "pickup <object>",
                 "go through <open door>", "toggle and go through <door>", "pickup", "drop", "toggle",
                 "check available actions")
PICKABLE = ("key", "ball", "box")


class BabyAIEnv:
    def __init__(self):
        self._env = None
        self._level = None
        self._visible: dict[str, tuple[int, int]] = {}  # object name in the last observation -> cell
        self._observation = ""
        self._view = None  # (grid, visibility) of the agent's current view, from minigrid
        self._score = 0.0  # the episode's reward so far: minigrid's success reward, or 0
        self._success = False

    @property
    def minigrid_env(self):
        """The underlying minigrid env (for expert bots and inspection)."""
        return self._env

    def reset(self, data_idx: int) -> dict:
        level, seed = levels.level_and_seed(data_idx)
        if level != self._level:
            self.close()
            self._env, self._level = levels.make(level), level
            self._keep_views(self._env)
        self._env.reset(seed=seed)
        self._env.gen_obs_grid()  # some levels change the grid after their reset's view (e.g. start carrying)
        self._score, self._success = 0.0, False
        self._observation = self._describe()
        return self._answer(0.0, False)

    def step(self, action: str) -> dict:
        command = action.strip().lower().rstrip(".!")
        if command == CHECK:
            self._observation = self._describe()
            return {**self._answer(0.0, False), "valid_action": True}
        plan = self._plan(command)
        if isinstance(plan, str):  # why the action cannot be carried out; the world is unchanged
            self._observation = f"{plan}\n{self._describe()}"
            # A known command form that cannot be carried out (an unseen object) was still an action.
            valid = command in PRIMITIVES or command.startswith(HIGH_LEVEL)
            return {**self._answer(0.0, False), "valid_action": valid}
        reward, done = 0.0, False
        for primitive in plan:
            _, r, terminated, truncated, _ = self._env.step(primitive)
            reward += float(r)
            if terminated or truncated:
                done = True
                break
        self._score += reward
        self._success = self._success or (done and reward > 0)
        self._observation = self._describe()
        return {**self._answer(reward, done), "valid_action": True}

    def _answer(self, reward: float, done: bool) -> dict:
        # "score" is this step's reward, as the original's (minigrid rewards only the last step).
        return {"observation": self._observation, "reward": reward, "score": reward, "done": done,
                "episode_score": self._score, "success": self._success}

    def observation(self) -> str:
        return self._observation

    def _keep_views(self, env) -> None:
        """minigrid computes the agent's view at the end of every step (the costliest part of a
        step); keep it so the text observation does not compute it a second time."""
        compute = env.gen_obs_grid

        def gen_obs_grid(agent_view_size=None):
            self._view = compute(agent_view_size)
            return self._view

        env.gen_obs_grid = gen_obs_grid

    def close(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None

    # -- actions ----------------------------------------------------------------------------
    def _plan(self, command: str) -> list[Actions] | str:
        if command in PRIMITIVES:
            return [PRIMITIVES[command]]
        for prefix in HIGH_LEVEL:
            if command.startswith(prefix):
                target = command[len(prefix):].strip()
                if target not in self._visible:
                    seen = ", ".join(self._visible) or "nothing"
                    return f"You cannot see {target!r} (visible: {seen})."
                return self._expand(prefix.strip(), target)
        return f"{command!r} is not a valid action. Valid command forms: {', '.join(COMMAND_FORMS)}."

    def _expand(self, verb: str, target: str) -> list[Actions] | str:
        cell = self._visible[target]
        path = self._path_to_face(cell)
        if path is None:
            return f"There is no path to the {target}."
        if verb == "go to":
            # Facing it already: a no-op move still lets minigrid check "go to" missions.
            return path or [Actions.done]
        if verb in ("pickup", "pick up"):
            return path + [Actions.pickup]
        door = self._env.grid.get(*cell)
        if door is None or door.type != "door":
            return f"The {target} is not a door."
        opening = [] if door.is_open else [Actions.toggle]
        if verb == "go through" and opening:
            return f"The {target} is not open: toggle and go through it."
        return path + opening + [Actions.forward, Actions.forward]

    def _path_to_face(self, target: tuple[int, int]) -> list[Actions] | None:
        """Shortest turn/move sequence that leaves the agent facing `target` (BFS over pose)."""
        env = self._env
        start = (int(env.agent_pos[0]), int(env.agent_pos[1]), int(env.agent_dir))
        parents = {start: None}
        queue = collections.deque([start])
        while queue:
            pose = queue.popleft()
            x, y, d = pose
            dx, dy = DIR_TO_VEC[d]
            if (x + dx, y + dy) == target:
                moves = []
                while parents[pose] is not None:
                    pose, move = parents[pose]
                    moves.append(move)
                return moves[::-1]
            steps = [((x, y, (d - 1) % 4), Actions.left), ((x, y, (d + 1) % 4), Actions.right)]
            ahead = env.grid.get(x + dx, y + dy)
            if ahead is None or ahead.can_overlap():
                steps.append(((x + dx, y + dy, d), Actions.forward))
            for nxt, move in steps:
                if nxt not in parents:
                    parents[nxt] = (pose, move)
                    queue.append(nxt)
        return None

    # -- observation ------------------------------------------------------------------------
    def _describe(self) -> str:
        env = self._env
        view, vis = self._view
        size = env.agent_view_size
        ax, ay = int(env.agent_pos[0]), int(env.agent_pos[1])
        fx, fy = DIR_TO_VEC[env.agent_dir]
        rx, ry = -fy, fx  # the agent's right, as minigrid's right_vec
        seen = []  # (forward, |lateral|, lateral, name, absolute cell)
        wall_ahead = None
        for vy in range(size):
            for vx in range(size):
                forward, lateral = size - 1 - vy, vx - size // 2
                obj = view.get(vx, vy)
                if obj is None or not vis[vx, vy] or (forward == 0 and lateral == 0):  # 0,0: what it carries
                    continue
                if obj.type == "wall":
                    if lateral == 0 and (wall_ahead is None or forward < wall_ahead):
                        wall_ahead = forward
                elif obj.type in PICKABLE or obj.type == "door":
                    cell = (ax + forward * fx + lateral * rx, ay + forward * fy + lateral * ry)
                    seen.append((forward, abs(lateral), lateral, _name(obj), cell))
        seen.sort()
        counts = collections.Counter()
        self._visible = {}
        lines = [f"Your goal: {env.mission}"]
        sentences = []
        for forward, _, lateral, kind, cell in seen:
            counts[kind] += 1
            name = f"{kind} {counts[kind]}"
            self._visible[name] = cell
            sentences.append(f"There is a {name} {_where(forward, lateral)}.")
        if sentences:
            lines.append("In front of you in this room, you can see several objects: " + " ".join(sentences))
        else:
            lines.append("You cannot see any objects in front of you.")
        walls = "The room has walls around you."
        if wall_ahead is not None:
            walls += f" You are facing a wall {wall_ahead} steps away."
        lines.append(walls)
        carrying = env.carrying
        lines.append(f"You are carrying a {_name(carrying)}." if carrying else "You are not carrying anything.")
        lines.append("Available actions: " + json.dumps(self.available_actions()))
        return "\n".join(lines)

    def available_actions(self) -> list[str]:
        """The actions the observation lists (what random valid play chooses from)."""
        env = self._env
        actions = ["turn left", "turn right", "move forward"]
        for name, cell in self._visible.items():
            obj = env.grid.get(*cell)
            if obj.type == "door":
                actions.append(f"go through {name}" if obj.is_open else f"toggle and go through {name}")
            elif env.carrying is None:
                actions.append(f"pickup {name}")
            actions.append(f"go to {name}")
        if env.carrying is not None:
            actions.append("drop")
        front = env.grid.get(*env.front_pos)
        if front is not None and front.type in ("door", "box"):
            actions.append("toggle")
        actions.append(CHECK)
        return actions


def _name(obj) -> str:
    if obj.type == "door":
        state = "locked" if obj.is_locked else "open" if obj.is_open else "closed"
        return f"{obj.color} {state} door"
    return f"{obj.color} {obj.type}"


def _where(forward: int, lateral: int) -> str:
    parts = []
    if forward:
        parts.append(f"{forward} steps in front of you")
    if lateral:
        parts.append(f"{abs(lateral)} steps to your {'left' if lateral < 0 else 'right'}")
    return " and ".join(parts)
