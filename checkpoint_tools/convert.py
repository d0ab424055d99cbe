"""Hugging Face <-> megatron-core conversion, and GGUF -> Hugging Face.

    python -m checkpoint_tools.convert import    --hf DIR --out DIR [--tp T --pp P]
    python -m checkpoint_tools.convert export    --ckpt DIR --out DIR [--tp T --pp P]
    python -m checkpoint_tools.convert roundtrip --hf DIR [--tp T --pp P]
    python -m checkpoint_tools.convert compare   --hf DIR --ckpt DIR [--tp T --pp P]
    python -m checkpoint_tools.convert from-gguf --gguf FILE --out DIR

``import`` writes a megatron dist-checkpoint (model only) that loads at any TP/PP layout;
``export`` writes HF safetensors shards with config and tokenizer (transformers and vLLM load
them); ``roundtrip`` imports and exports and checks every tensor is bitwise equal; ``compare``
reports logits on fixed prompts: max abs difference and next-token agreement. ``from-gguf`` writes
a GGUF file (llama.cpp's format) as an HF directory through transformers' GGUF reader: weights
dequantised (float32 for a quantised file; the dtype transformers gives), config, tokenizer,
chat template and generation config; it runs in this process, on no ranks.

Under torchrun the ranks are torchrun's (their count must be TP * PP); otherwise TP * PP local
ranks are spawned. Bad input (missing file, unsupported architecture, a tensor of the wrong
shape) exits with code 2 and a message naming it; outputs are written atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from agentgym_mega.errors import EXIT_BAD_INPUT
from agentgym_mega.models import gguf
from agentgym_mega.models.conversion import run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m checkpoint_tools.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    specs = {
        "import": (("--hf", "HF model directory"), ("--out", "checkpoint root to write")),
        "export": (("--ckpt", "checkpoint (or root with a `latest` file)"), ("--out", "HF directory to write")),
        "roundtrip": (("--hf", "HF model directory"),),
        "compare": (("--hf", "HF model directory"), ("--ckpt", "checkpoint (or root)")),
    }
    for name, options in specs.items():
        p = sub.add_parser(name)
        for flag, help_text in options:
            p.add_argument(flag, required=True, help=help_text)
        p.add_argument("--tp", type=int, default=1, help="tensor parallel size to run at")
        p.add_argument("--pp", type=int, default=1, help="pipeline parallel size to run at")
    what = ("GGUF file -> HF directory through transformers' GGUF reader; weights are dequantised and saved "
            "in the dtype transformers loads the file in (float32 for a quantised file such as Q4_1; the "
            "result's \"dtype\" says which)")
    p = sub.add_parser("from-gguf", help=what, description=what)
    p.add_argument("--gguf", required=True, help="GGUF file to read (quantised weights are dequantised)")
    p.add_argument("--out", required=True, help="HF directory to write (replaced whole once complete)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kwargs = {k: v for k, v in vars(args).items() if k != "command"}
    try:
        result = gguf.to_hf(**kwargs) if args.command == "from-gguf" else run(args.command, **kwargs)
    except (FileNotFoundError, ValueError) as exc:  # bad input found before any rank started (BadInput is a ValueError)
        result = {"error": str(exc)}
    if "WORLD_SIZE" in os.environ and int(os.environ.get("RANK", 0)) != 0:
        return 0
    print(json.dumps(result, indent=2))
    if "error" in result:
        print(f"convert {args.command}: {result['error']}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0 if result.get("bitwise_equal", True) else 1


if __name__ == "__main__":
    sys.exit(main())
