import json
import os

import pytest


@pytest.fixture(scope="session")
def megatron_models(tmp_path_factory) -> dict:
    """Tiny models shaped for TP=2 (two KV heads): Qwen2 with tied embeddings and QKV bias; Llama
    untied, with llama3 rope scaling and a vocabulary (509) that TP must pad."""
    from agentgym_mega.models.tiny import TinySpec, make_tiny_model

    root = tmp_path_factory.mktemp("megatron-models")
    qwen2 = make_tiny_model(str(root / "qwen2"), TinySpec(arch="qwen2", heads=4, kv_heads=2, layers=2))
    llama = make_tiny_model(str(root / "llama"), TinySpec(arch="llama", heads=4, kv_heads=2, layers=2, vocab=509))
    path = os.path.join(llama, "config.json")
    with open(path) as f:
        config = json.load(f)
    # Llama 3.1's scaling recipe; with theta 5e5 the low-frequency half of head_dim 32 is scaled.
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192}
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return {"qwen2": qwen2, "llama": llama}


@pytest.fixture(scope="session")
def model_100m(tmp_path_factory) -> str:
    """A ~95M-parameter Llama (12 layers, hidden 768, 12 heads, 4 KV heads, vocab 8192, untied;
    380 MB fp32): big enough that weights, not the interpreter, dominate a rank's memory."""
    from agentgym_mega.models.tiny import TinySpec, make_tiny_model

    spec = TinySpec(arch="llama", layers=12, hidden=768, heads=12, kv_heads=4, vocab=8192, init_std=0.02)
    return make_tiny_model(str(tmp_path_factory.mktemp("model-100m") / "llama-100m"), spec)
