"""`agentgym-mega make-tiny-model`: a tiny random-init HF model with a BPE tokenizer."""

from __future__ import annotations

from agentgym_mega.cli.options import add_shape_args, command, validate_spec
from agentgym_mega.models.tiny import TinySpec, make_tiny_model


def add(sub) -> None:
    p = command(
        sub, "make-tiny-model", func=run,
        help="write a tiny random-init Qwen2/Llama HF model with a BPE tokenizer",
        description=(
            "Writes a Hugging Face model directory that transformers and vLLM both load: random\n"
            "weights, a byte-level BPE tokenizer trained on environment text, and a Qwen-style chat\n"
            "template (<|im_start|>role ... <|im_end|>). For tests and CPU demos, where no weights\n"
            "can be downloaded. head_dim = hidden/heads must be a multiple of 32 (vLLM CPU attention)."
        ),
    )
    p.add_argument("--arch", default="qwen2", choices=["qwen2", "llama"],
                   help="qwen2: tied embeddings, QKV bias; llama: untied, no bias")
    p.add_argument("--out", required=True, help="output directory")
    add_shape_args(p, kv_heads=1, vocab=512)


def run(args) -> int:
    spec = TinySpec(
        arch=args.arch, layers=args.layers, hidden=args.hidden, heads=args.heads,
        kv_heads=args.kv_heads, vocab=args.vocab, ffn=args.ffn, seed=args.seed,
    )
    validate_spec(spec)
    print(f"wrote {make_tiny_model(args.out, spec)}")
    return 0

