"""`bench sync`'s transport mode between real processes (no vLLM, no megatron): one row per
transport and receiver count, every row about the same model, and the sender's bytes scale as
each transport should: a full copy per receiver over ZMQ, one copy down the collective chain.
No timing assertions."""

from agentgym_mega.bench import sync


def test_run_transports_measures_what_leaves_the_sender():
    report = sync.run_transports([1, 2], ["zmq", "collective"], size_mb=2, bucket_mb=1, repeats=1)
    rows = {(r["transport"], r["receivers"]): r for r in report["rows"]}
    assert len(report["rows"]) == 4
    assert sorted(rows) == [("collective", 1), ("collective", 2), ("zmq", 1), ("zmq", 2)]

    model_bytes = sum(t.numel() * t.element_size() for _, t in sync.synthetic_model(2))
    assert report["model_bytes"] == model_bytes
    assert all(r["model_bytes"] == model_bytes for r in rows.values()), rows
    assert all(r["seconds"] > 0 and len(r["all_seconds"]) == 1 for r in rows.values()), rows

    for n in (1, 2):  # ZMQ sends each receiver its own copy
        assert rows["zmq", n]["sender_bytes"] >= n * model_bytes * 0.95, rows["zmq", n]
    # the chain: the sender sends one copy (plus headers and the vote), the receivers forward it
    assert 0.95 * model_bytes <= rows["collective", 2]["sender_bytes"] <= 1.1 * model_bytes, rows["collective", 2]


def test_synthetic_model_is_deterministic_and_about_the_size_asked():
    a, b = sync.synthetic_model(2), sync.synthetic_model(2)
    assert [n for n, _ in a] == [n for n, _ in b] and all(x.equal(y) for (_, x), (_, y) in zip(a, b))
    assert {str(t.dtype) for _, t in a} == {"torch.float32", "torch.bfloat16"}
    for size_mb in (2, 256):
        total = sum(sync._nbytes(shape, dtype) for _, shape, dtype in sync.synthetic_layout(size_mb))
        assert 0.9 * (size_mb << 20) <= total <= 1.1 * (size_mb << 20), (size_mb, total)
    largest = max(sync._nbytes(s, d) for _, s, d in sync.synthetic_layout(256))
    assert largest > 64 << 20  # bigger than a bucket at the defaults; the 4-element tensors are tiny
