"""`agentgym-mega pretrain-tiny`: a tiny base policy that knows an environment's action format but
not its strategy, for RL to improve on.

It plays episodes with uniformly random *valid* actions (never expert play), trains a byte-level
BPE tokenizer on the transcripts, and fits a tiny Llama by next-token loss on the assistant turns
only. Transcripts are tokenised turn by turn exactly as the rollout manager builds its episodes
(:class:`ChatTurns`), so RL starts from token sequences the model has seen.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time

import torch

from agentgym_mega.models.tiny import TinySpec, build_model, save_model, train_tokenizer
from agentgym_mega.rollout.manager import ChatTurns

REPLY = "Action: {}"
# Random play only knows how to choose among listed actions; environments without a list of valid
# actions in their observation cannot be played this way.
PLAYABLE = ("babyai",)


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
    """``episodes`` transcripts ``[(observation, action), ..., (final observation, None)]`` of
    uniformly random valid actions, cycling through ``task_ids``, and their scores."""
    if env_name not in PLAYABLE:
        raise ValueError(f"random play needs listed valid actions; env {env_name!r} not in {', '.join(PLAYABLE)}")
    from envs import load_kind

    rng = random.Random(seed)
    env = load_kind(env_name).make()
    transcripts, scores = [], []
    try:
        for i in range(episodes):
            observation = env.reset(task_ids[i % len(task_ids)])["observation"]
            turns, score = [], 0.0
            for _ in range(max_turns):
                action = rng.choice([a for a in env.available_actions() if a != "check available actions"])
                turns.append((observation, action))
                result = env.step(action)
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
    for (_, action), (observation, following) in zip(transcript, transcript[1:]):
        reply = turns.reply(REPLY.format(action))
        ids += reply
        mask += [1] * len(reply)
        if following is not None:  # the episode's last observation is never answered
            piece = turns.after_reply(reply, observation)
            ids += piece
            mask += [0] * len(piece)
    return ids, mask


def _batches(examples: list, batch_size: int, pad: int, rng: random.Random):
    """Right-padded batches of similar length (fewer padded tokens), in random order."""
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
    start = time.perf_counter()
    transcripts, scores = random_play(cfg.env, cfg.task_ids, cfg.episodes, cfg.max_turns, cfg.seed)
    success = sum(s > 0 for s in scores) / len(scores)
    texts = [text for t in transcripts for observation, action in t
             for text in (observation, REPLY.format(action) if action else "")]
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
