"""Tiny random-init Hugging Face models for tests and the CPU demo (no weights can be downloaded).

A tiny model is an ordinary HF directory: ``config.json``, ``model.safetensors``,
``generation_config.json`` and a byte-level BPE tokenizer trained with ``tokenizers`` on
environment text, with a Qwen-style chat template. ``transformers`` and vLLM load it as they
would a real Qwen2 or Llama checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os

from agentgym_mega.files import atomic_dir, commit_dir

# tokenizers, transformers, torch and the environments' text (minigrid) are imported inside the
# functions that use them: the CLI imports `TinySpec` to build its parser.

# Qwen's chat markup: every turn is `<|im_start|>role\n...<|im_end|>\n`; generation ends on <|im_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]
ARCHS = ("qwen2", "llama")
# Longest cross-word token, in characters: long enough for phrases like " steps in front of you".
MAX_CROSS_WORD_TOKEN = 24
WORD_RUN_REGEX = r"[A-Za-z0-9]+(?: [A-Za-z0-9]+)*"


@dataclasses.dataclass
class TinySpec:
    arch: str = "qwen2"
    layers: int = 2
    hidden: int = 128
    heads: int = 2
    kv_heads: int = 1
    vocab: int = 512
    ffn: int | None = None  # default: 3 x hidden
    max_positions: int = 4096
    # Wider than HF's 0.02 so a random model's greedy output varies with the prompt, which makes
    # generation and parity tests discriminating.
    init_std: float = 0.1
    seed: int = 0

    @property
    def mlp_width(self) -> int:
        return self.ffn or 3 * self.hidden

    def validate(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"--arch {self.arch!r}: allowed {', '.join(ARCHS)}")
        for name in ("layers", "hidden", "heads", "kv_heads", "vocab", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} is not divisible by --heads {self.heads}")
        head_dim = self.hidden // self.heads
        if head_dim < 32 or head_dim % 32:
            raise ValueError(
                f"head_dim = hidden/heads = {head_dim}: vLLM's CPU attention needs a multiple of 32"
            )
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} is not divisible by --kv-heads {self.kv_heads}")
        if self.vocab < 300:
            raise ValueError(f"--vocab {self.vocab}: byte-level BPE needs at least 300 (256 bytes + specials)")


def train_tokenizer(vocab: int, corpus: list[str], cross_word: bool = False):
    """Byte-level BPE with the chat special tokens.

    By default it splits words with Qwen2's pre-tokenizer: transformers loads any `qwen2` model's
    tokenizer as Qwen2Tokenizer, which imposes that split regex, so training with it keeps training
    and use identical. ``cross_word`` merges across the spaces of a run of words but never across
    punctuation, so an action phrase is the same tokens in a reply as in the observation's quoted
    list of actions (a tiny model can then copy it) and episodes get about twice shorter; only
    Llama models load such a tokenizer.json as written."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    split = WORD_RUN_REGEX if cross_word else PRETOKENIZE_REGEX
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=MAX_CROSS_WORD_TOKEN if cross_word else None,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


def _hf_config(spec: TinySpec, tokenizer):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.mlp_width,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        initializer_range=spec.init_std,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        bos_token_id=None,
        torch_dtype="float32",
    )
    if spec.arch == "qwen2":
        # Qwen2 small models tie the LM head to the embedding; Llama 3 does not.
        return Qwen2Config(tie_word_embeddings=True, **common)
    return LlamaConfig(tie_word_embeddings=False, attention_bias=False, mlp_bias=False, **common)


def build_model(spec: TinySpec, tokenizer):
    """A random-init HF model for ``spec`` whose special ids are ``tokenizer``'s."""
    import torch
    from transformers import AutoModelForCausalLM

    spec.validate()
    torch.manual_seed(spec.seed)
    return AutoModelForCausalLM.from_config(_hf_config(spec, tokenizer), dtype=torch.float32)


def save_model(model, tokenizer, spec: TinySpec, out: str, extra: dict | None = None) -> str:
    """Writes the HF directory (weights, tokenizer, generation config, the spec it came from and
    ``extra`` JSON files by name) atomically: it appears complete or not at all, replacing any
    previous one, so an interrupted run never leaves a directory that looks loadable."""
    from transformers import GenerationConfig

    tmp = atomic_dir(out)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    GenerationConfig(
        eos_token_id=model.config.eos_token_id, pad_token_id=model.config.pad_token_id, do_sample=True
    ).save_pretrained(tmp)
    files = {"tiny_spec.json": dataclasses.asdict(spec)} | (extra or {})
    for name, content in files.items():
        with open(os.path.join(tmp, name), "w") as f:
            json.dump(content, f, indent=2)
    commit_dir(tmp, out)
    return out


def make_tiny_model(out: str, spec: TinySpec) -> str:
    """Writes a random-init HF model directory at ``out`` and returns its path; the tokenizer
    learns the environments' text."""
    from envs.corpus import text_corpus

    spec.validate()
    tokenizer = train_tokenizer(spec.vocab, text_corpus())
    return save_model(build_model(spec, tokenizer), tokenizer, spec, out)
