"""The collective weight-sync transport between real processes on gloo, without an engine:
bytes arrive intact, the sender's bytes do not grow with receivers (chain), and any failure
(a rejected tensor, a receiver that dies mid-sync, a sender whose source fails) makes every
member roll back, promptly."""

import datetime
import multiprocessing as mp
import queue
import time

import pytest
import torch.distributed as dist

from agentgym_mega.weight_sync.collective import GroupSpec, new_group_id
from tests.unit import collective_peers as peers

# The groups' timeout is long on purpose: a failure must be noticed through the protocol (the
# vote, a broken link, an ABORT), and a run that waited for this timeout instead would take over
# PROMPT_S. Process start-up counts too, hence the margin on a loaded 2-core machine.
TIMEOUT_S = 180.0
PROMPT_S = 90.0


def run(receivers: int, *, stages: int = 1, algorithm: str = "chain", bucket_bytes: int = 8192, version: int = 5,
        sender_kw: dict | None = None, receiver_kw: dict | None = None, backend: str = "gloo",
        timeout_s: float = TIMEOUT_S):
    """Runs one sync: one sender per stage, `receivers` receivers; returns results by member."""
    stores = [dist.TCPStore("127.0.0.1", 0, 1 + receivers, is_master=True, wait_for_workers=False,
                            timeout=datetime.timedelta(seconds=timeout_s)) for _ in range(stages)]
    spec = GroupSpec(new_group_id(), tuple(("127.0.0.1", s.port) for s in stores), 1 + receivers, backend,
                     algorithm, bucket_bytes, timeout_s).as_dict()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=peers.send, args=(spec, s, version, results), kwargs=sender_kw or {})
             for s in range(stages)]
    for rank in range(1, receivers + 1):
        kw = dict((receiver_kw or {}).get(rank, {}), stages=stages)
        procs.append(ctx.Process(target=peers.receive, args=(spec, rank, version, results), kwargs=kw))
    start = time.monotonic()
    for p in procs:
        p.start()
    out = {}
    expected = stages + receivers - sum(1 for kw in (receiver_kw or {}).values() if "die_after" in kw)
    try:
        while len(out) < expected:
            role, who, status, info = results.get(timeout=TIMEOUT_S + 60)
            out[(role, who)] = (status, info)
    except queue.Empty:
        pytest.fail(f"members did not report within {TIMEOUT_S + 60:.0f} s: got {sorted(out)}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return out, time.monotonic() - start


@pytest.mark.parametrize("algorithm", ["chain", "broadcast"])
def test_every_receiver_gets_every_byte(algorithm):
    out, _ = run(3, algorithm=algorithm)
    assert out[("sender", 0)][0] == "ok", out
    for rank in (1, 2, 3):
        status, info = out[("receiver", rank)]
        assert status == "ok" and info["equal"] and info["error"] is None, out


def test_chain_sender_sends_the_model_once_whatever_the_receivers():
    model_bytes = sum(t.numel() * t.element_size() for _, t in peers.model(0))
    sent = {}
    for receivers in (1, 4):
        out, _ = run(receivers, bucket_bytes=64 << 10)
        status, info = out[("sender", 0)]
        assert status == "ok" and info["bytes"] == model_bytes
        sent[receivers] = info["sent"]
    # headers and the vote add a little; a broadcast tree would send 3x at 4 receivers
    assert sent[1] >= model_bytes and sent[4] <= 1.1 * model_bytes, (sent, model_bytes)
    assert sent[4] <= 1.1 * sent[1], sent


def test_stages_send_at_once_and_each_receiver_takes_them_in_order():
    out, _ = run(2, stages=2)
    assert out[("sender", 0)][0] == out[("sender", 1)][0] == "ok", out
    for rank in (1, 2):
        status, info = out[("receiver", rank)]
        assert status == "ok" and info["equal"] and info["error"] is None, out
        # one stage at a time (NCCL promises no progress to two communicators at once): every
        # tensor of stage 0 before any of stage 1, whichever sender was faster
        stages = [int(name.split(".")[0].removeprefix("stage")) for name in info["order"]]
        assert stages == sorted(stages) and set(stages) == {0, 1}, info["order"]


def test_a_member_that_never_joins_is_named_by_the_sender():
    out, seconds = run(2, receiver_kw={2: {"absent": True}}, timeout_s=10.0)
    status, error = out[("sender", 0)]
    assert status == "error" and "weight-sync group of stage 0: rank 2 did not join within 10 s" in error, out
    assert seconds < PROMPT_S


def test_a_receiver_that_refuses_rolls_every_member_back():
    out, seconds = run(3, receiver_kw={2: {"reject": True}})
    assert out[("sender", 0)][0] == "error" and "not taken" in out[("sender", 0)][1]
    assert all(out[("receiver", r)][0] == "rolled back" for r in (1, 2, 3)), out
    assert "refused" in out[("receiver", 2)][1]["error"]
    assert seconds < PROMPT_S  # decided by the vote, not by a timeout


def test_a_receiver_killed_mid_sync_rolls_every_other_member_back():
    out, seconds = run(3, receiver_kw={2: {"die_after": 1}})
    assert out[("sender", 0)][0] == "error", out
    assert out[("receiver", 1)][0] == out[("receiver", 3)][0] == "rolled back", out
    assert seconds < PROMPT_S, seconds  # a dead peer breaks its links at once


def test_a_source_that_fails_aborts_the_receivers_at_once():
    out, seconds = run(2, sender_kw={"fail_after": 2})
    assert out[("sender", 0)] == ("error", "RuntimeError: the gather failed"), out
    for rank in (1, 2):
        status, info = out[("receiver", rank)]
        assert status == "rolled back" and "aborted version 5" in info["error"], out
    assert seconds < PROMPT_S


def test_a_commit_of_another_version_is_refused_by_every_member():
    out, _ = run(2, receiver_kw={1: {"expect": 6}})
    assert out[("sender", 0)][0] == "error", out
    assert "expects version 6" in out[("receiver", 1)][1]["error"]
    assert out[("receiver", 2)][0] == out[("receiver", 1)][0] == "rolled back", out
