"""Multi-turn rollouts against a real vLLM engine and real TextCraft servers (Ray processes)."""

import threading
import time

import pytest
import requests
import torch

from agentgym_mega.rollout.engines import SamplingConfig
from agentgym_mega.rollout.manager import RolloutManager
from envs.environment import Task

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    import ray
    from transformers import AutoTokenizer

    from agentgym_mega.models.tiny import TinySpec, make_tiny_model
    from agentgym_mega.rollout.engines.vllm_engine import VLLMEngine
    from agentgym_mega.rollout.env_client import EnvClient, start_servers

    model = make_tiny_model(str(tmp_path_factory.mktemp("m") / "tiny"), TinySpec())
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    servers, urls = start_servers("textcraft", 2)
    engine = VLLMEngine(model, max_model_len=2048)
    yield {"engine": engine, "servers": servers, "urls": urls, "env": EnvClient(urls),
           "tokenizer": AutoTokenizer.from_pretrained(model)}
    engine.shutdown()
    ray.shutdown()


def manager(stack, max_tokens=16, max_model_len=2048):
    sampling = SamplingConfig(temperature=1.0, max_tokens=max_tokens)
    return RolloutManager([stack["engine"]], stack["env"], stack["tokenizer"], sampling, max_model_len)


def test_token_bookkeeping(stack):
    tok = stack["tokenizer"]
    batch = manager(stack).collect([Task(3, "depth1"), Task(130, "depth2")], n_per_task=2, max_turns=2)
    assert len(batch) == 4 and batch.group_ids.tolist() == [0, 0, 1, 1]
    assert [e.task_id for e in batch.episodes] == [3, 3, 130, 130]
    for row, episode in enumerate(batch.episodes):
        assert episode.status in ("done", "horizon") and 1 <= episode.turns <= 2
        n = int(batch.attention_mask[row].sum())
        mask = batch.loss_mask[row, :n].bool()
        ids = batch.input_ids[row, :n].tolist()
        # Every trained token carries the engine's log-prob, nothing else does.
        assert (batch.rollout_logprobs[row, :n][mask] < 0).all()
        assert (batch.rollout_logprobs[row, :n][~mask] == 0).all()
        assert int(mask.sum()) == episode.response_tokens
        # The prompt is the chat template around the first observation: never trained on.
        text = tok.decode(ids)
        assert text.startswith("<|im_start|>user\n") and not mask[0]
        # Between assistant turns, the observation turn is template text the policy did not produce.
        if episode.turns == 2:
            assert text.count("<|im_start|>assistant\n") == 2
        # The terminal reward sits on the last trained token.
        last = int(mask.nonzero()[-1])
        assert batch.rewards[row].nonzero().flatten().tolist() in ([last], [])
        assert batch.rewards[row, last] == episode.score
        _check_transcript(episode, ids, mask.tolist(), tok)
    assert [e.transcript["sample"] for e in batch.episodes] == [0, 1, 0, 1]


def _check_transcript(episode, ids, mask, tok):
    """The episode's text record (what saved episodes hold) agrees with its tokens: each turn's
    reply is its sampled ids decoded, its action what the server read from it, its observation
    the text of the turn the rollout appended, and the token counts add up."""
    from envs.environment import extract_action

    record = episode.transcript
    turns = record["turns"]
    assert len(turns) == episode.turns and record["observation"] in tok.decode(ids[: record["tokens"]["prompt"]])
    assert record["tokens"] == {"prompt": record["tokens"]["prompt"], "response": episode.response_tokens,
                                "total": len(ids)}
    assert record["tokens"]["prompt"] + sum(t["tokens"] + t["observation_tokens"] for t in turns) == len(ids)
    at = record["tokens"]["prompt"]
    for turn in turns:
        reply = ids[at: at + turn["tokens"]]
        assert all(mask[at: at + turn["tokens"]]) and turn["text"] == tok.decode(reply, skip_special_tokens=True)
        assert turn["action"] == extract_action(turn["text"])
        assert turn["valid_action"] == (turn["action_error"] is None)
        at += turn["tokens"]
        if turn["observation_tokens"]:
            assert turn["observation"] in tok.decode(ids[at: at + turn["observation_tokens"]])
        at += turn["observation_tokens"]
        assert turn["generate_s"] > 0 and turn["env_s"] > 0
    assert record["weight_version"] == 0 and record["time_s"] > 0


def test_context_limit_truncates_and_is_recorded(stack):
    batch = manager(stack, max_tokens=64, max_model_len=300).collect([Task(5)], n_per_task=2, max_turns=10)
    assert {e.status for e in batch.episodes} <= {"truncated", "done"}
    assert batch.input_ids.shape[1] <= 300
    assert any(e.status == "truncated" for e in batch.episodes)


def test_a_killed_env_server_ends_only_its_episodes(stack):
    """Server 1 dies while the rollout runs: its episodes end as env_error (untrained), the
    others finish, and collect() returns."""
    import ray

    victim_url = stack["urls"][1]

    def kill_when_busy():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if requests.get(victim_url + "/health", timeout=5).json()["instances"] > 0:
                ray.kill(stack["servers"][1])
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    batch = manager(stack, max_tokens=24).collect([Task(i) for i in range(4)], n_per_task=2, max_turns=4)
    killer.join()
    # instances are dealt round-robin: odd rows lived on the killed server
    dead = [e for i, e in enumerate(batch.episodes) if i % 2 == 1]
    alive = [e for i, e in enumerate(batch.episodes) if i % 2 == 0]
    assert all(e.status == "env_error" and "unavailable" in e.error for e in dead)
    assert all(e.status in ("done", "horizon") for e in alive)
    assert torch.all(batch.loss_mask[1::2] == 0) and torch.all(batch.loss_mask[0::2].sum(-1) > 0)


def test_config_instruction_opens_episodes_and_seeds_repeat_them(stack):
    import envs
    from agentgym_mega.config import load_config
    from agentgym_mega.rollout.env_client import EnvClient

    env = EnvClient(stack["urls"][:1])  # server 0: the test above kills server 1

    cfg = load_config(None, ["env.name=textcraft", "rollout.max_tokens_per_turn=16", "rollout.max_model_len=2048"])
    managed = RolloutManager.from_config(cfg, [stack["engine"]], env, stack["tokenizer"])
    tasks = [Task(3), Task(130)]
    first = managed.collect(tasks, n_per_task=2, max_turns=2, seed=(0, 1))
    for row in range(len(first)):
        user_turn = stack["tokenizer"].decode(first.input_ids[row]).split("<|im_end|>")[0]
        assert envs.instruction("textcraft") in user_turn  # the environment's own instruction
    again = managed.collect(tasks, n_per_task=2, max_turns=2, seed=(0, 1))
    assert torch.equal(first.input_ids, again.input_ids)  # the same seed samples the same episodes
    # ... while samples of one task still differ: every request has its own seed
    replies = [tuple(first.input_ids[r][first.loss_mask[r].bool()].tolist()) for r in range(len(first))]
    assert replies[0] != replies[1] and replies[2] != replies[3]
    other = managed.collect(tasks, n_per_task=2, max_turns=2, seed=(0, 2))
    assert not torch.equal(first.input_ids[:, :other.input_ids.shape[1]], other.input_ids[:, :first.input_ids.shape[1]])

    cfg = load_config(None, ["env.name=textcraft", "env.instruction=Be brief."])
    managed = RolloutManager.from_config(cfg, [stack["engine"]], env, stack["tokenizer"])
    text = stack["tokenizer"].decode(managed.collect([Task(3)], n_per_task=2, max_turns=1).input_ids[0])
    assert "Be brief." in text and envs.instruction("textcraft") not in text


def test_seeded_prompts_past_one_engine_step_sample_and_repeat(stack):
    """32 different 400-token prompts are more than one engine step takes (4096 tokens): vLLM
    would split one across steps, which for a seeded request on CPU killed the engine."""
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(400)] for _ in range(32)]
    sampling = SamplingConfig(temperature=1.0, max_tokens=4)
    first = stack["engine"].generate(prompts, sampling, list(range(32)))
    again = stack["engine"].generate(prompts, sampling, list(range(32)))
    assert len(first) == 32 and all(g.token_ids for g in first)
    assert [g.token_ids for g in first] == [g.token_ids for g in again]


def test_async_episodes_are_token_identical_to_lockstep(stack):
    """The same tasks, seeds and weights through both modes: every row's ids, masks, log-probs
    and reward, and every episode's ending, are the same. Turn caps differ per task, so episodes
    end at different turns and the async engine batches requests from different turns."""
    from agentgym_mega.rollout.env_client import EnvClient

    env = EnvClient(stack["urls"][:1])  # server 0: another test kills server 1
    tasks = [Task(3), Task(130), Task(7), Task(250)]
    batches = {}
    for mode in ("lockstep", "async"):
        managed = RolloutManager([stack["engine"]], env, stack["tokenizer"],
                                 SamplingConfig(temperature=1.0, max_tokens=24), 2048, mode=mode)
        batches[mode] = managed.collect(tasks, n_per_task=3, max_turns=[1, 4, 2, 3], seed=(5, 1))
        assert 0 < managed.timings["rollout/engine_busy_fraction"] <= 1
        assert managed.timings["time/generate_s"] > 0 and managed.timings["time/env_s"] > 0
    lock, asy = batches["lockstep"], batches["async"]
    assert [e.turns for e in lock.episodes] != [lock.episodes[0].turns] * len(lock)  # a long tail
    assert max(e.turns for e in lock.episodes[:3]) == 1 and max(e.turns for e in lock.episodes[3:6]) <= 4
    for name in ("input_ids", "attention_mask", "loss_mask", "rewards", "group_ids", "scores"):
        assert torch.equal(getattr(lock, name), getattr(asy, name)), name
    assert torch.allclose(lock.rollout_logprobs, asy.rollout_logprobs, atol=1e-5)
    assert [(e.status, e.turns, e.response_tokens) for e in lock.episodes] == \
        [(e.status, e.turns, e.response_tokens) for e in asy.episodes]


def test_timeouts_end_only_their_episodes(stack):
    """A frozen env server (SIGSTOP after the resets) answers no step: with rollout.env_step_timeout_s
    its episodes end as `timeout`, untrained, and the other server's finish. A wall-clock limit
    shorter than any generation ends every episode as `timeout` in either mode."""
    import os
    import signal

    from agentgym_mega.metrics import episode_metrics
    from agentgym_mega.rollout.env_client import EnvClient
    from tests.envs.conftest import running

    with running("textcraft") as frozen:
        class FreezesAfterReset(EnvClient):
            def reset(self, handles, data_idxs):
                results = super().reset(handles, data_idxs)
                os.kill(frozen.proc.pid, signal.SIGSTOP)
                return results

        env = FreezesAfterReset([stack["urls"][0], frozen.url], timeout=2)
        managed = RolloutManager([stack["engine"]], env, stack["tokenizer"],
                                 SamplingConfig(temperature=1.0, max_tokens=16), 2048, mode="async",
                                 env_step_timeout_s=1.0)
        try:
            batch = managed.collect([Task(3), Task(130)], n_per_task=2, max_turns=3, seed=(0, 1))
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        frozen_rows, live_rows = batch.episodes[1::2], batch.episodes[0::2]  # instances dealt round-robin
        assert all(e.status == "timeout" and "1 s" in e.error and e.turns == 1 for e in frozen_rows)
        assert all(e.status in ("done", "horizon") for e in live_rows)
        assert torch.all(batch.loss_mask[1::2] == 0) and torch.all(batch.loss_mask[0::2].sum(-1) > 0)
        assert episode_metrics(batch)["episode/timeouts"] == 2 and batch.valid.tolist() == [True, False] * 2

    for mode in ("lockstep", "async"):
        managed = RolloutManager([stack["engine"]], EnvClient(stack["urls"][:1]), stack["tokenizer"],
                                 SamplingConfig(temperature=1.0, max_tokens=16), 2048, mode=mode,
                                 episode_timeout_s=1e-4)
        batch = managed.collect([Task(3)], n_per_task=2, max_turns=3)
        assert {e.status for e in batch.episodes} == {"timeout"} and "wall-clock" in batch.episodes[0].error
        assert int(batch.loss_mask.sum()) == 0


def test_dynamic_sampling_keeps_groups_with_spread_and_repeats(stack):
    """rollout.dynamic_sampling through vLLM and a TextCraft server (a random model seldom crafts
    anything, so most groups are flat; tests/unit/test_dynamic_sampling.py checks the choices
    against hand-computed draws): the batch holds trainer.batch_size groups, draws stop at the
    limit when spread is short, the figures agree with the task sampler, and the same step
    repeated (a resumed run) draws the same tasks and keeps the same groups."""
    from agentgym_mega.config import load_config
    from agentgym_mega.rollout.dynamic_sampling import collect_batch, groups_with_spread
    from agentgym_mega.rollout.env_client import EnvClient
    from agentgym_mega.rollout.tasks import TaskSampler

    cfg = load_config(None, ["env.name=textcraft", "rollout.max_tokens_per_turn=16", "rollout.max_model_len=2048",
                             "rollout.n_per_task=2", "trainer.batch_size=3", "trainer.mini_batch_size=1",
                             "rollout.dynamic_sampling=true", "rollout.dynamic_sampling_max_draws=2",
                             "rollout.mode=async"])
    managed = RolloutManager.from_config(cfg, [stack["engine"]], EnvClient(stack["urls"][:1]), stack["tokenizer"])
    tasks = [Task(i) for i in range(0, 400, 7)]
    runs = []
    for _ in range(2):
        sampler = TaskSampler(tasks, seed=0)
        batch, metrics = collect_batch(managed, sampler, cfg, step=1, max_turns=2)
        runs.append((batch, metrics, sampler.position))
    (batch, metrics, position), (again, _, position_again) = runs
    assert len(batch) == 6 and batch.group_ids.tolist() == [g for g in range(3) for _ in range(2)]
    assert metrics["rollout/groups_drawn"] == position and 3 <= position <= 6
    assert metrics["rollout/groups_dropped"] == position - 3
    kept_spread = len(groups_with_spread(batch))
    assert metrics["rollout/groups_flat_kept"] == 3 - kept_spread
    assert kept_spread == 3 or position == 6  # short of spread only once the draws are spent
    assert position_again == position and torch.equal(batch.input_ids, again.input_ids)


def test_evaluations_of_the_same_weights_sample_the_same_episodes(stack, tmp_path):
    """Evaluation requests are seeded (step -1 of the run's seed; `evaluation.held_out`, which
    `agentgym-mega eval` runs too): two evaluations of equal weights play the same tokens, so
    held-out comparisons carry no sampling noise."""
    from agentgym_mega.config import load_config
    from agentgym_mega.evaluation import Evaluator
    from agentgym_mega.rollout.env_client import EnvClient

    cfg = load_config(None, ["env.name=textcraft", "rollout.max_tokens_per_turn=8", "rollout.max_model_len=2048",
                             "eval.n=2", "eval.max_turns=2", f"trainer.output_dir={tmp_path}"])
    managed = RolloutManager.from_config(cfg, [stack["engine"]], EnvClient(stack["urls"][:1]), stack["tokenizer"])
    batches = []

    class Recording:
        def collect(self, *args, **kwargs):
            batches.append(managed.collect(*args, **kwargs))
            return batches[-1]

    evaluate = Evaluator(Recording(), [Task(3), Task(130)], cfg)
    first, _ = evaluate(0)
    again, _ = evaluate(1)
    assert first == again and torch.equal(batches[0].input_ids, batches[1].input_ids)
    replies = [tuple(batches[0].input_ids[r][batches[0].loss_mask[r].bool()].tolist()) for r in range(4)]
    assert replies[0] != replies[1]  # each request its own seed, not one seed for all
    assert (tmp_path / "eval" / "step_1.json").exists()


def _idle_within(engine, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while engine.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    return engine.health()["running"] == 0


def test_a_generation_past_the_wall_clock_limit_leaves_the_engine(stack, monkeypatch):
    """An episode whose limit passes mid-generation ends as `timeout` and its request is aborted
    in vLLM at once: the engine is idle within a second, where a request left running takes
    seconds more (~1700 tokens take 4-7 s here). An abort reaches a call that has not started
    too."""
    from agentgym_mega.rollout.env_client import EnvClient

    engine, sampling = stack["engine"], SamplingConfig(temperature=1.0, max_tokens=1800)
    aborted, abort = [], engine.abort
    monkeypatch.setattr(engine, "abort", lambda key: aborted.append(key) or abort(key))
    managed = RolloutManager([engine], EnvClient(stack["urls"][:1]), stack["tokenizer"], sampling, 2048,
                             mode="async", episode_timeout_s=1.0)
    # Replies may end early (the end-of-turn token), so an episode may also run out of time between
    # turns; with four episodes and no turn cap in reach, some are caught generating.
    batch = managed.collect([Task(3)], n_per_task=4, max_turns=50, seed=(0, 1))
    assert all(e.status == "timeout" for e in batch.episodes)
    generating = {(i, e.turns) for i, e in enumerate(batch.episodes) if "while generating" in e.error}
    assert generating
    assert _idle_within(engine, 1.0)
    # each of those requests was aborted by name (key: uuid-episode-turn), and no other
    assert {tuple(int(part) for part in key.split("-")[1:]) for key in aborted} == generating

    prompts, result = [[5] * 300, [7] * 300], {}
    call = threading.Thread(target=lambda: result.update(out=engine.generate(prompts, sampling, [0, 1], key="k")))
    call.start()
    deadline = time.monotonic() + 30
    while not engine.health()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    engine.abort("k")
    call.join(timeout=5)
    assert not call.is_alive() and result["out"] == [] and _idle_within(engine, 1.0)
    engine.abort("early")
    assert engine.generate(prompts, sampling, [0, 1], key="early") == [] and engine.health()["running"] == 0
    assert [len(g.token_ids) for g in engine.generate(prompts, SamplingConfig(max_tokens=4), [0, 1])] == [4, 4]


def test_a_cpu_engine_has_no_worker_process_of_its_own(stack):
    """At TP=1 on CPU the worker runs inside vLLM's engine-core process (the uniproc executor):
    the mp executor's separate worker busy-waits after every message, taking half a core."""
    import psutil

    names = [p.name() for p in psutil.Process().children(recursive=True)]
    assert any(n.startswith("VLLM::EngineCore") for n in names), names
    assert not any(n.startswith("VLLM::Worker") for n in names), names


def test_shutdown_ends_running_calls_with_an_error_and_logs_none(stack):
    """A generate call still running when the engine shuts down raises, rather than hanging or
    returning nothing; later calls raise too; a second shutdown does nothing. vLLM's own shutdown
    ends the engine core before its output handler, which then often logs the dead engine as an
    error at a normal stop (vllm#48745): the handler must be done first, and nothing logged."""
    import logging

    from agentgym_mega.rollout.engines.vllm_engine import VLLMEngine

    records = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logging.getLogger("vllm").addHandler(handler)
    try:
        engine = VLLMEngine(stack["tokenizer"].name_or_path, max_model_len=2048)
        try:
            result = {}

            def generate():
                try:
                    result["out"] = engine.generate([[5] * 300], SamplingConfig(max_tokens=1700), [0])
                except RuntimeError as error:
                    result["error"] = str(error)

            call = threading.Thread(target=generate)
            call.start()
            deadline = time.monotonic() + 30
            while not engine.health()["running"] and time.monotonic() < deadline:
                time.sleep(0.02)
            assert engine.health()["running"] == 1
            # Whether vLLM's order logs the error is a race between two threads; the order is not.
            core, output_handler, handler_done = engine.llm.engine_core, engine.llm.output_handler, []
            core_shutdown = core.shutdown
            core.shutdown = lambda *a, **k: handler_done.append(output_handler.done()) or core_shutdown(*a, **k)
            engine.shutdown()
            assert handler_done[:1] == [True]
            call.join(timeout=10)
            assert not call.is_alive() and "shut down during this generate call" in result.get("error", ""), result
            with pytest.raises(RuntimeError, match="engine is shut down"):
                engine.generate([[5]], SamplingConfig(max_tokens=2))
        finally:
            engine.shutdown()  # the second call, or the first after a failure
    finally:
        logging.getLogger("vllm").removeHandler(handler)
    assert [r.getMessage() for r in records] == []
