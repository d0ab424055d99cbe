"""`pretrain-tiny`'s parts: random *valid* play, transcripts tokenised exactly as the rollout
manager builds episodes, the cross-word tokenizer, and a short pretraining run."""

import json

import pytest
import torch

from agentgym_mega.models.tiny import train_tokenizer
from agentgym_mega.pretrain import REPLY, encode, random_play
from agentgym_mega.rollout.manager import ChatTurns

LEVEL_IDS = [seed * 40 + 1 for seed in range(10, 20)]  # GoToRedBall, train seeds


@pytest.fixture(scope="module")
def play():
    return random_play("babyai", LEVEL_IDS, 24, 4, seed=3)


@pytest.fixture(scope="module")
def tokenizer(play):
    transcripts, _ = play
    texts = [text for t in transcripts for obs, action in t for text in (obs, REPLY.format(action) if action else "")]
    return train_tokenizer(600, texts, cross_word=True)


def listed(observation: str) -> list[str]:
    return json.loads(observation.rsplit("Available actions: ", 1)[1])


def test_random_play_only_takes_listed_actions_and_is_seeded(play):
    transcripts, scores = play
    assert len(transcripts) == len(scores) == 24
    for turns in transcripts:
        assert 1 <= len(turns) - 1 <= 4 and turns[-1][1] is None
        for observation, action in turns[:-1]:
            assert action in listed(observation) and action != "check available actions"
    assert all(0.0 <= s <= 1.0 for s in scores) and any(s > 0 for s in scores)
    again, _ = random_play("babyai", LEVEL_IDS, 24, 4, seed=3)
    other, _ = random_play("babyai", LEVEL_IDS, 24, 4, seed=4)
    assert again == transcripts and other != transcripts


def test_random_play_refuses_an_env_without_listed_actions():
    with pytest.raises(ValueError, match="listed valid actions"):
        random_play("textcraft", [0], 1, 1, 0)


def test_encoded_transcript_is_the_chat_rendering_with_replies_masked(play, tokenizer):
    turns = ChatTurns(tokenizer)
    for transcript in play[0][:6]:
        ids, mask = encode(transcript, turns)
        messages = []
        for observation, action in transcript:
            messages.append({"role": "user", "content": observation})
            if action is not None:
                messages.append({"role": "assistant", "content": REPLY.format(action)})
        rendered = tokenizer.apply_chat_template(messages[:-1], tokenize=False)  # the last observation is unanswered
        assert tokenizer.decode(ids) == rendered.rstrip("\n")
        trained = [i for i, m in zip(ids, mask) if m]
        assert tokenizer.decode(trained) == "".join(f"{REPLY.format(a)}<|im_end|>" for _, a in transcript[:-1])


def test_cross_word_tokens_are_the_same_in_a_reply_and_in_the_listed_actions(play, tokenizer, tmp_path):
    from transformers import AutoTokenizer

    observation, action = play[0][0][0]
    encode_text = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    phrase = encode_text(action)
    reply = encode_text(REPLY.format(action))
    listing = encode_text(observation)
    assert reply[-len(phrase):] == phrase
    assert any(listing[i: i + len(phrase)] == phrase for i in range(len(listing)))
    assert len(encode_text("go to red ball 1")) < len("go to red ball 1".split())  # merged across words
    tokenizer.save_pretrained(tmp_path)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "llama"}, f)
    loaded = AutoTokenizer.from_pretrained(tmp_path)  # what vLLM and the trainer load
    assert loaded(observation, add_special_tokens=False)["input_ids"] == listing


def test_pretrain_fits_the_replies_and_writes_a_loadable_model(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentgym_mega.models.tiny import TinySpec
    from agentgym_mega.pretrain import PretrainConfig, pretrain

    spec = TinySpec(arch="llama", layers=1, hidden=64, heads=2, kv_heads=2, ffn=128, init_std=0.02)
    cfg = PretrainConfig(task_ids=LEVEL_IDS, episodes=64, max_turns=3, epochs=4, batch_size=8, lr=5e-3, vocab=600)
    summary = pretrain(str(tmp_path), spec, cfg, log=lambda _: None)
    assert summary["final_loss"] < 0.6 * summary["initial_loss"]
    saved = json.loads((tmp_path / "pretrain.json").read_text())
    assert saved["steps"] == 4 * 8 and 0 < saved["random_play_success"] < 1
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert model.config.vocab_size == len(tok) and model.config.model_type == "llama"
    ids = torch.tensor([tok("Action: turn left")["input_ids"]])
    assert torch.isfinite(model(ids).logits).all()


def test_model_directory_appears_whole_and_replaces_the_previous_one(tmp_path, tokenizer, monkeypatch):
    from agentgym_mega.models import tiny

    spec = tiny.TinySpec(arch="llama", layers=1, hidden=64, heads=2, kv_heads=2, ffn=128, vocab=len(tokenizer))
    out = tmp_path / "model"
    tiny.save_model(tiny.build_model(spec, tokenizer), tokenizer, spec, str(out), extra={"note.json": {"a": 1}})
    assert json.loads((out / "note.json").read_text()) == {"a": 1} and (out / "model.safetensors").exists()

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(type(tokenizer), "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        tiny.save_model(tiny.build_model(spec, tokenizer), tokenizer, spec, str(out), extra={"note.json": {"a": 2}})
    assert json.loads((out / "note.json").read_text()) == {"a": 1}  # the previous directory is untouched
