"""`python -m checkpoint_tools.convert from-gguf` on a GGUF file written here with the `gguf`
package's own writer (float32 tensors, llama.cpp's names and Q/K row order) from a tiny random
Llama: the directory it writes loads in transformers with the logits of transformers' direct GGUF
load and of the model the file was written from; a file transformers cannot read exits 2."""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

LOGIT_TOL = 1e-5  # float32 throughout: the same numbers, computed by the same code
QWEN2_PRE = "qwen2"  # the tiny tokenizer splits words with Qwen2's regex (models/tiny.py)


def convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "checkpoint_tools.convert", *args],
                          capture_output=True, text=True, timeout=600, cwd=REPO)


def _llama_cpp_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Q/K rows in llama.cpp's rotary order (its convert_hf_to_gguf permute), which transformers'
    GGUF reader undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, tokenizer, path: str) -> None:
    """``model`` (a LlamaForCausalLM) and ``tokenizer`` (byte-level BPE) as a float32 GGUF file."""
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    vocab = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(QWEN2_PRE)
    writer.add_token_list(sorted(vocab["vocab"], key=vocab["vocab"].get))
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(vocab["vocab"]))])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in vocab["merges"]])
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name.endswith("q_proj.weight"):
            tensor = _llama_cpp_rows(tensor, cfg.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            tensor = _llama_cpp_rows(tensor, cfg.num_key_value_heads)
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight",)), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(GGUF path, the model it was written from): a Llama with 3 heads and 1 KV head, untied."""
    from agentgym_mega.models.tiny import TinySpec, build_model, train_tokenizer

    tokenizer = train_tokenizer(320, open(__file__).read().splitlines())  # any text with enough words
    model = build_model(TinySpec(arch="llama", hidden=96, heads=3, kv_heads=1, vocab=len(tokenizer)), tokenizer)
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")
    write_gguf(model, tokenizer, path)
    return path, model


def test_from_gguf_writes_a_directory_with_the_logits_of_the_gguf(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, source = tiny_gguf
    out = str(tmp_path / "hf")
    proc = convert("from-gguf", "--gguf", path, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["architecture"] == "LlamaForCausalLM" and report["dtype"] == "float32", report
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
            "generation_config.json"} <= set(os.listdir(out))
    assert "quantization_config" not in json.load(open(os.path.join(out, "config.json")))
    assert json.load(open(os.path.join(out, "gguf_source.json"))) == {
        "gguf": "tiny-llama.F32.gguf", "sha256": hashlib.sha256(open(path, "rb").read()).hexdigest()}
    folder, name = os.path.split(path)
    direct = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    converted = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tokenizer("Your goal: go to the red ball")["input_ids"]])
    with torch.no_grad():
        want, got, original = direct(ids).logits, converted(ids).logits, source(ids).logits
    assert (got - want).abs().max().item() <= LOGIT_TOL
    assert (got - original).abs().max().item() <= LOGIT_TOL  # the Q/K row order came back right
    assert not converted.config.tie_word_embeddings and converted.config.num_key_value_heads == 1
    turn = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert turn == "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("damage", ["truncated", "not_gguf", "other_architecture"])
def test_a_file_transformers_cannot_read_exits_2_with_the_reason_and_writes_nothing(tiny_gguf, tmp_path, damage):
    path, _ = tiny_gguf
    bad = tmp_path / "bad.gguf"
    data = open(path, "rb").read()
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "not_gguf":
        bad.write_text('{"this": "is json"}')
    else:  # the same bytes, declared an architecture transformers has no GGUF mapping for
        bad.write_bytes(data.replace(b"llama", b"xlama", 1))
    out = tmp_path / "hf"
    proc = convert("from-gguf", "--gguf", str(bad), "--out", str(out))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert str(bad) in proc.stderr
    reason = {"truncated": "transformers cannot read it", "not_gguf": "not a GGUF file",
              "other_architecture": "xlama"}[damage]
    assert reason in proc.stderr, proc.stderr[-3000:]
    assert not out.exists() and os.listdir(tmp_path) == ["bad.gguf"]
