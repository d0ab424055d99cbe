"""Deep Search's dense retriever with its encoder on CUDA, as `retriever build` runs on a GPU node
(the default where torch sees a GPU): the same ranking as the CPU encoder. Skipped without CUDA."""

import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_a_dense_index_built_on_cuda_ranks_as_the_cpu_one(tmp_path):
    for extra in ("faiss", "sentence_transformers"):  # the `dense` extra: not in the GPU image's lock
        pytest.importorskip(extra, reason="needs the dense extra (pip install -e '.[dense]')")
    from envs.deepsearch.options import DATA_DIR
    from envs.deepsearch.retriever import PASSAGES, build_index, load_index
    from tests.envs.tiny_encoder import make_tiny_encoder

    corpus = tmp_path / "corpus.jsonl"
    with open(f"{DATA_DIR}/{PASSAGES}") as f:
        rows = [json.loads(line) for _, line in zip(range(300), f)]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    encoder = make_tiny_encoder(tmp_path / "encoder", [f"passage: {r['contents']}" for r in rows])
    queries = [r["contents"].split("\n", 1)[0] + " born" for r in rows[:20]]
    found = {}
    for device in ("cpu", "cuda"):
        build_index(str(corpus), str(tmp_path / device), encoder, progress=False, device=device)
        found[device] = load_index(str(tmp_path / device), "dense", device=device).search(queries, 3)
    for cpu, cuda in zip(found["cpu"], found["cuda"]):
        assert [h["id"] for h in cuda] == [h["id"] for h in cpu]
        assert max(abs(a["score"] - b["score"]) for a, b in zip(cpu, cuda)) < 1e-3  # TF32/cuBLAS vs CPU
