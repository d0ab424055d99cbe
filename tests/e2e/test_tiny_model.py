"""The tiny-model factory writes HF directories that transformers loads and vLLM serves."""

import json
import os

import pytest
import torch

from agentgym_mega.models.tiny import IM_END, IM_START, PAD
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def cli_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_tiny")
    made = {}
    for arch, extra in (("qwen2", []), ("llama", ["--heads", "4", "--kv-heads", "2"])):
        out = str(root / arch)
        result = run_cli("make-tiny-model", "--arch", arch, "--out", out, "--layers", "2", *extra)
        assert result.returncode == 0, result.stderr
        made[arch] = out
    return made


@pytest.mark.parametrize("arch,cls,tied", [("qwen2", "Qwen2ForCausalLM", True), ("llama", "LlamaForCausalLM", False)])
def test_transformers_loads_and_generates(cli_models, arch, cls, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = cli_models[arch]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == cls
    assert model.config.tie_word_embeddings is tied
    assert model.config.hidden_size // model.config.num_attention_heads >= 32
    assert model.config.vocab_size >= len(tokenizer)
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids(IM_END)
    ids = tokenizer("Your goal: go to the red ball", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_tokenizer_has_qwen_chat_markup_and_round_trips_env_text(cli_models):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cli_models["qwen2"])
    messages = [{"role": "user", "content": "Goal: craft 1 loom."},
                {"role": "assistant", "content": "Action: inventory"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\nGoal: craft 1 loom.<|im_end|>\n"
        "<|im_start|>assistant\nAction: inventory<|im_end|>\n<|im_start|>assistant\n"
    )
    for special in (PAD, IM_START, IM_END):
        assert len(tokenizer(special, add_special_tokens=False).input_ids) == 1
    sample = "craft 4 oak planks using 1 oak logs\nThere is a grey key 1 1 steps in front of you. é✓"
    ids = tokenizer(sample, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == sample  # byte-level: any text survives
    env_line = "Action: craft 1 crafting table using 4 oak planks"
    # trained on environment text: frequent words are merged (under one token per two bytes)
    assert len(tokenizer(env_line, add_special_tokens=False).input_ids) < len(env_line) / 2


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_loaded_tokenizer_encodes_exactly_as_trained(cli_models, arch):
    """transformers may swap in an architecture's own tokenizer class (Qwen2Tokenizer imposes
    its split regex); ids must still equal those of the trained tokenizer.json."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from envs.corpus import text_corpus

    trained = Tokenizer.from_file(os.path.join(cli_models[arch], "tokenizer.json"))
    loaded = AutoTokenizer.from_pretrained(cli_models[arch])
    for text in text_corpus()[::25]:
        assert loaded(text, add_special_tokens=False).input_ids == trained.encode(text).ids


def test_spec_records_the_requested_shape(cli_models):
    with open(os.path.join(cli_models["llama"], "tiny_spec.json")) as f:
        spec = json.load(f)
    with open(os.path.join(cli_models["llama"], "config.json")) as f:
        config = json.load(f)
    assert (spec["heads"], spec["kv_heads"]) == (4, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)


@pytest.mark.parametrize("args,message", [
    (["--hidden", "64", "--heads", "4"], "head_dim"),
    (["--heads", "4", "--kv-heads", "3", "--hidden", "128"], "--kv-heads"),
    (["--vocab", "100"], "--vocab"),
])
def test_impossible_shapes_exit_2_without_writing(tmp_path, args, message):
    out = tmp_path / "m"
    result = run_cli("make-tiny-model", "--out", str(out), *args)
    assert result.returncode == 2 and message in result.stderr
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_vllm_generates_with_transformers_parity(cli_models, arch, tmp_path):
    """vLLM (CPU) greedy tokens equal transformers' greedy tokens, and the log-probs vLLM reports
    for them match transformers' log_softmax to 1e-4 (fp32; seen: about 1e-6)."""
    report = tmp_path / "doctor.json"
    result = run_cli("doctor", "--checks", "vllm", "--model", cli_models[arch], "--json", str(report))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    vllm = json.loads(report.read_text())["vllm"]
    assert vllm["greedy_match"] is True
    assert vllm["max_abs_logprob_diff"] <= 1e-4
    assert all(len(s) > 0 for s in vllm["samples"])
