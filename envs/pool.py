"""The live instances of one environment kind: ids, a cap, idle eviction, per-instance locking,
episode state, and failure isolation. The HTTP layer (`envs.server`) only translates to and from
JSON; everything a client can get wrong is decided here and raised as a `PoolError` with the
HTTP status it maps to.

The cap on live instances follows from memory: `memory_share` of the memory available when the
pool starts, divided by what one instance of the kind costs (`Kind.instance_bytes`), at least 1.
An explicit `max_instances` can only lower it. Past the cap /create answers 503; instances
unused for `idle_timeout` seconds are closed by a sweeper (their ids then answer 404).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil

from envs import limits
from envs.environment import InstanceFailed, InvalidCreate, InvalidTask, Kind

log = logging.getLogger(__name__)


class PoolError(Exception):
    status = 400


class BadRequest(PoolError):
    status = 400


class UnknownInstance(PoolError):
    status = 404


class EpisodeState(PoolError):
    status = 409


class Failed(PoolError):
    status = 500


class TooLarge(PoolError):
    status = 413


class ServerFull(PoolError):
    status = 503


class _Instance:
    __slots__ = ("env", "lock", "last_used", "has_episode", "done", "failure", "closed")

    def __init__(self, env):
        self.env = env
        self.lock = threading.Lock()  # one operation at a time per instance
        self.last_used = time.monotonic()
        self.has_episode = False
        self.done = False
        self.failure: str | None = None
        self.closed = False

    def close(self) -> None:
        with self.lock:
            self.closed = True
            _close_quietly(self.env)


def memory_cap(instance_bytes: int, available_bytes: int, share: float) -> int:
    """How many instances fit in `share` of `available_bytes` (at least one)."""
    return max(1, int(share * available_bytes) // instance_bytes)


class InstancePool:
    def __init__(self, kind: Kind, max_instances: int | None = None, idle_timeout: float = 600.0,
                 memory_share: float = limits.MEMORY_SHARE, max_batch_ops: int = limits.MAX_BATCH_OPS,
                 max_action_chars: int = limits.MAX_ACTION_CHARS):
        require_count("max_batch_ops", max_batch_ops)
        require_count("max_action_chars", max_action_chars)
        if max_instances is not None:
            require_count("max_instances", max_instances)
        if idle_timeout <= 0:
            raise ValueError(f"idle_timeout={idle_timeout} is not allowed; allowed: seconds > 0")
        if not 0 < memory_share <= 1:
            raise ValueError(f"memory_share={memory_share} is not allowed; allowed: a fraction in (0, 1]")
        self.kind = kind
        available = psutil.virtual_memory().available
        self.memory_cap = memory_cap(kind.instance_bytes, available, memory_share)
        memory = (f"the memory cap {self.memory_cap} = {memory_share:.0%} of {available / 2**30:.1f} GiB "
                  f"available at start-up / {_size(kind.instance_bytes)} per {kind.name} instance")
        if max_instances is not None and max_instances < self.memory_cap:
            self.max_instances, self.cap_reason = max_instances, f"--max-instances {max_instances}, under {memory}"
        else:
            self.max_instances, self.cap_reason = self.memory_cap, memory
        self.idle_timeout = idle_timeout
        self.max_batch_ops = max_batch_ops
        self.max_action_chars = max_action_chars
        self._instances: dict[int, _Instance] = {}
        self._reserved = 0  # slots taken by creations still starting (a JVM is slow to start)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._batch = ThreadPoolExecutor(kind.batch_threads) if kind.batch_threads > 1 else None
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_forever, name="idle-sweeper", daemon=True)
        self._sweeper.start()

    # -- lifecycle of instances -------------------------------------------------------------
    def create(self, body: dict | None = None) -> dict | int:
        """A new instance: {"id"}. `body` is AgentGym's /create body, when one came: the kind checks
        its fields; a kind that starts on create (TextCraft) also answers the first reset of
        data_idx = id, as the original server did; one of the env_idx dialect starts the task
        the body names and answers the bare id."""
        if body is not None:
            try:
                self.kind.check_create(body)
                if self.kind.env_idx_task is not None:  # refused before an instance exists
                    self.kind.check_data_idx(body.get(self.kind.env_idx_task, 0))
            except (InvalidCreate, InvalidTask) as exc:
                raise BadRequest(str(exc)) from None
        instance_id = self._new_instance()
        if body is not None and self.kind.env_idx_task is not None:
            self.reset(instance_id, body.get(self.kind.env_idx_task, 0))
            return instance_id
        if body is not None and self.kind.starts_on_create:
            return {"id": instance_id, **self.reset(instance_id, instance_id)}
        if self.kind.env_idx_task is not None:  # the dialect's client reads env_idx (WebArena's)
            return {"id": instance_id, "env_idx": instance_id}
        return {"id": instance_id}

    def _new_instance(self) -> int:
        with self._lock:
            if len(self._instances) + self._reserved >= self.max_instances:
                raise ServerFull(
                    f"server full: {self.max_instances} live instances, the cap ({self.cap_reason}); "
                    "close instances you no longer need"
                )
            self._reserved += 1
        try:
            env = self.kind.make()
        except Exception as exc:
            log.exception("creating a %s instance failed", self.kind.name)
            raise Failed(f"could not create a {self.kind.name} instance: {exc}") from None
        finally:
            with self._lock:
                self._reserved -= 1
        with self._lock:
            instance_id = next(self._ids)
            self._instances[instance_id] = _Instance(env)
        return instance_id

    def close(self, instance_id) -> bool:
        instance_id = _check_id(instance_id)
        with self._lock:
            inst = self._instances.pop(instance_id, None)
        if inst is None:
            raise UnknownInstance(_unknown(instance_id, self.idle_timeout))
        inst.close()
        return True

    def __len__(self) -> int:
        return len(self._instances)

    def shutdown(self) -> None:
        self._stop.set()
        with self._lock:
            instances, self._instances = list(self._instances.values()), {}
        for inst in instances:
            inst.close()
        if self._batch:
            self._batch.shutdown(wait=False)

    # -- episodes ---------------------------------------------------------------------------
    def reset(self, instance_id, data_idx) -> dict:
        try:
            data_idx = self.kind.check_data_idx(data_idx)
        except InvalidTask as exc:
            raise BadRequest(str(exc)) from None
        with self._use(instance_id) as inst:
            result = self._guarded(inst, instance_id, lambda: inst.env.reset(data_idx))
            inst.has_episode, inst.done = True, bool(result.get("done", False))
            return result

    def step(self, instance_id, action) -> dict:
        if not isinstance(action, str):
            raise BadRequest(f"action must be a string, given {type(action).__name__}")
        if len(action) > self.max_action_chars:
            raise BadRequest(f"the action has {len(action)} characters; the cap is {self.max_action_chars} "
                             "(--max-action-chars)")
        with self._use(instance_id) as inst:
            if not inst.has_episode:
                raise EpisodeState(f"instance {instance_id} has no episode yet: POST /reset first")
            if inst.done:
                raise EpisodeState(f"the episode of instance {instance_id} is finished: POST /reset to start another")
            parsed = self.kind.parse_action(action)
            result = self._guarded(inst, instance_id, lambda: inst.env.step(parsed))
            inst.done = bool(result["done"])
            return {**result, "action": parsed}

    def observation(self, instance_id) -> str:
        with self._use(instance_id) as inst:
            if not inst.has_episode:
                raise EpisodeState(f"instance {instance_id} has no episode yet: POST /reset first")
            return self._guarded(inst, instance_id, inst.env.observation)

    # -- the batched path -------------------------------------------------------------------
    def batch(self, ops) -> list[dict]:
        """Runs many operations in one call; each result is its own success or {"error", "status"}."""
        if not isinstance(ops, list) or not ops:
            raise BadRequest('expected {"ops": [...]}, a non-empty list of operations')
        if len(ops) > self.max_batch_ops:
            raise TooLarge(f"{len(ops)} operations in one /batch; the cap is {self.max_batch_ops} "
                           "(--max-batch-ops): send them in several")
        if self._batch is None:
            return [self._one(op) for op in ops]
        return list(self._batch.map(self._one, ops))

    def _one(self, op) -> dict:
        try:
            if not isinstance(op, dict):
                raise BadRequest(f"each operation must be an object, given {op!r}")
            name = op.get("op")
            if name == "create":
                return self.create()
            if name == "reset":
                return self.reset(op.get("id"), op.get("data_idx"))
            if name == "step":
                return self.step(op.get("id"), op.get("action"))
            if name == "observation":
                return {"observation": self.observation(op.get("id"))}
            if name == "close":
                return {"closed": self.close(op.get("id"))}
            raise BadRequest(f"op={name!r} is not allowed; allowed: create, reset, step, observation, close")
        except PoolError as exc:
            return {"error": str(exc), "status": exc.status}

    # -- internals --------------------------------------------------------------------------
    def _use(self, instance_id):
        instance_id = _check_id(instance_id)
        with self._lock:
            inst = self._instances.get(instance_id)
        if inst is None:
            raise UnknownInstance(_unknown(instance_id, self.idle_timeout))
        return _Using(inst, instance_id)

    def _guarded(self, inst: _Instance, instance_id: int, call):
        """Runs one env call; any crash marks only this instance failed, never the server."""
        if inst.failure:
            raise Failed(f"instance {instance_id} failed earlier ({inst.failure}); close it and create another")
        try:
            return call()
        except InstanceFailed as exc:
            inst.failure = str(exc)
        except Exception as exc:
            log.exception("instance %s crashed", instance_id)
            inst.failure = f"{type(exc).__name__}: {exc}"
        raise Failed(f"instance {instance_id} failed: {inst.failure}; close it and create another")

    def _sweep_forever(self) -> None:
        period = min(self.idle_timeout / 2, 10.0)
        while not self._stop.wait(period):
            self.evict_idle()

    def evict_idle(self) -> int:
        cutoff = time.monotonic() - self.idle_timeout
        with self._lock:
            idle = [i for i, inst in self._instances.items() if inst.last_used < cutoff and not inst.lock.locked()]
            evicted = [self._instances.pop(i) for i in idle]
        for inst in evicted:
            inst.close()
        if evicted:
            log.info("evicted %d idle %s instances", len(evicted), self.kind.name)
        return len(evicted)


class _Using:
    """Holds an instance's lock for one operation and stamps its last use."""

    def __init__(self, inst: _Instance, instance_id: int):
        self.inst, self.instance_id = inst, instance_id

    def __enter__(self) -> _Instance:
        self.inst.lock.acquire()
        if self.inst.closed:  # closed by another request while this one waited for the lock
            self.inst.lock.release()
            raise UnknownInstance(f"instance {self.instance_id} was closed")
        self.inst.last_used = time.monotonic()
        return self.inst

    def __exit__(self, *exc) -> None:
        self.inst.last_used = time.monotonic()
        self.inst.lock.release()


def _size(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n / 2**10:g} KiB"


def require_count(name: str, value, error: type[ValueError] = ValueError) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise error(f"{name}={value!r} is not allowed; allowed: an integer >= 1")


def _check_id(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"id={value!r} is not allowed; allowed: an integer id returned by /create")
    return value


def _unknown(instance_id: int, idle_timeout: float) -> str:
    return (f"unknown id {instance_id}: never created, closed, or evicted after {idle_timeout:g} s idle; "
            "POST /create for a new one")


def _close_quietly(env) -> None:
    try:
        env.close()
    except Exception:
        log.exception("closing an instance failed")
