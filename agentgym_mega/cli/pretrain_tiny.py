"""`agentgym-mega pretrain-tiny`: a tiny base policy pretrained on random valid play."""

from __future__ import annotations

import os

from agentgym_mega.cli.options import COUNT, add_shape_args, command, validate_spec
from agentgym_mega.models.tiny import TinySpec
from agentgym_mega.pretrain import PLAYABLE, PretrainConfig, pretrain
from agentgym_mega.rollout.tasks import select_tasks
from envs import load_kind

# torch is imported when the command runs: --help should not pay for it.


def add(sub) -> None:
    p = command(
        sub, "pretrain-tiny", func=run,
        help="pretrain a tiny base policy on random valid play (knows the format, not the strategy)",
        description=(
            "Plays --episodes episodes of the environment with uniformly random valid replies on\n"
            "train-split tasks (of --categories), trains a byte-level BPE tokenizer on them (merging\n"
            "across words, so action phrases become single tokens) and fits a tiny Llama by\n"
            "next-token loss on the assistant replies only. The replies are the environment's own\n"
            "format: BabyAI `Action: <a listed action>`; TextCraft `Action: get <count> <item>` (an\n"
            "ingredient no shown recipe makes), `Action: craft ...` (a shown recipe, a group such as\n"
            "planks named as a kind shown) or `Action: inventory`; Deep Search `<think>...</think>`\n"
            "then `<search>2-5 words of the question</search>` or, once passages are shown, half the\n"
            "time `<answer>a shown passage's title</answer>`. The result is an HF directory for\n"
            "`train` (model.path): a policy that answers in the action format about as well as\n"
            "random valid play, for RL to improve on. Writes pretrain.json beside it."
        ),
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--env", default="babyai", choices=PLAYABLE, help="environment (one random play knows)")
    p.add_argument("--categories", type=lambda s: [c for c in s.split(",") if c],
                   help="comma-separated task categories (BabyAI level names; TextCraft depths, e.g. "
                        "depth-1,depth-2; Deep Search data sources, e.g. single,twohop); default all")
    p.add_argument("--episodes", type=COUNT, default=2000)
    p.add_argument("--epochs", type=COUNT, default=2)
    p.add_argument("--max-turns", type=COUNT, default=6, help="turns per episode")
    p.add_argument("--batch-size", type=COUNT, default=32, help="episodes per step")
    p.add_argument("--lr", type=float, default=5e-3, help="peak AdamW rate (cosine decay to 0)")
    add_shape_args(p, kv_heads=2, vocab=1024)


def run(args) -> int:
    import torch

    tasks = select_tasks(load_kind(args.env).tasks(), "train", None, args.categories, key="--categories")
    spec = TinySpec(arch="llama", layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                    vocab=args.vocab, ffn=args.ffn, init_std=0.02, seed=args.seed)
    validate_spec(spec)
    torch.set_num_threads(os.cpu_count() or 1)
    cfg = PretrainConfig(env=args.env, task_ids=[t.id for t in tasks], episodes=args.episodes, max_turns=args.max_turns,
                         epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, vocab=args.vocab, seed=args.seed)
    summary = pretrain(args.out, spec, cfg)
    print(f"wrote {args.out}: loss {summary['final_loss']:.3f} after {summary['steps']} steps, "
          f"{summary['seconds']:.0f}s")
    return 0

