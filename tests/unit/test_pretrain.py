"""`pretrain-tiny`'s parts: random *valid* play, transcripts tokenised exactly as the rollout
manager builds episodes, the cross-word tokenizer, and a short pretraining run."""

import json

import pytest
import torch

from agentgym_mega.models.tiny import train_tokenizer
from agentgym_mega.pretrain import encode, question_words, random_play
from agentgym_mega.rollout.manager import ChatTurns
from envs.deepsearch.env import parse_action

LEVEL_IDS = [seed * 40 + 1 for seed in range(10, 20)]  # GoToRedBall, train seeds
QUESTION_IDS = list(range(0, 700, 35))  # Deep Search's shipped train questions, both sources


@pytest.fixture(scope="module")
def play():
    return random_play("babyai", LEVEL_IDS, 24, 4, seed=3)


@pytest.fixture(scope="module")
def tokenizer(play):
    transcripts, _ = play
    return train_tokenizer(600, [text for t in transcripts for turn in t for text in turn if text], cross_word=True)


def listed(observation: str) -> list[str]:
    return json.loads(observation.rsplit("Available actions: ", 1)[1])


def test_random_play_only_takes_listed_actions_and_is_seeded(play):
    transcripts, scores = play
    assert len(transcripts) == len(scores) == 24
    for turns in transcripts:
        assert 1 <= len(turns) - 1 <= 4 and turns[-1][1] is None
        for observation, reply in turns[:-1]:
            action = reply.removeprefix("Action: ")
            assert reply.startswith("Action: ") and action in listed(observation)
            assert action != "check available actions"
    assert all(0.0 <= s <= 1.0 for s in scores) and any(s > 0 for s in scores)
    again, _ = random_play("babyai", LEVEL_IDS, 24, 4, seed=3)
    other, _ = random_play("babyai", LEVEL_IDS, 24, 4, seed=4)
    assert again == transcripts and other != transcripts


def test_random_play_refuses_an_env_it_cannot_play():
    with pytest.raises(ValueError, match="random valid reply"):
        random_play("sciworld", [0], 1, 1, 0)


def test_deep_search_random_play_searches_question_words_and_answers_shown_titles():
    transcripts, scores = random_play("deepsearch", QUESTION_IDS, 40, 5, seed=3)
    assert len(transcripts) == len(scores) == 40
    kinds = set()
    for turns in transcripts:
        words = question_words(turns[0][0])
        assert turns[0][0].startswith("Question: ") and turns[-1][1] is None
        for (observation, reply), (following, _) in zip(turns, turns[1:]):
            kind, text = parse_action(reply)
            kinds.add(kind)
            if kind == "search":
                query = text.split()
                assert 2 <= len(query) <= 5 and any(words[i: i + len(query)] == query for i in range(len(words)))
                assert following.startswith("<information>")
            else:
                assert f"(Title: {text}) " in observation
    assert kinds == {"search", "answer"}
    success = sum(s > 0 for s in scores) / len(scores)
    print(f"Deep Search random-play success {success:.2f}")
    assert 0 <= success <= 1 and all(s in (0.0, 1.0) for s in scores)
    again, _ = random_play("deepsearch", QUESTION_IDS, 40, 5, seed=3)
    other, _ = random_play("deepsearch", QUESTION_IDS, 40, 5, seed=4)
    assert again == transcripts and other != transcripts


@pytest.mark.parametrize("env", ["babyai", "deepsearch"])
def test_encoded_transcript_is_the_chat_rendering_with_replies_masked(env, play, tokenizer):
    transcripts = play[0] if env == "babyai" else random_play("deepsearch", QUESTION_IDS, 6, 4, seed=3)[0]
    turns = ChatTurns(tokenizer)
    for transcript in transcripts[:6]:
        ids, mask = encode(transcript, turns)
        messages = []
        for observation, reply in transcript:
            messages.append({"role": "user", "content": observation})
            if reply is not None:
                messages.append({"role": "assistant", "content": reply})
        rendered = tokenizer.apply_chat_template(messages[:-1], tokenize=False)  # the last observation is unanswered
        assert tokenizer.decode(ids) == rendered.rstrip("\n")
        trained = [i for i, m in zip(ids, mask) if m]
        assert tokenizer.decode(trained) == "".join(f"{r}<|im_end|>" for _, r in transcript[:-1])


def test_cross_word_tokens_are_the_same_in_a_reply_and_in_the_listed_actions(play, tokenizer, tmp_path):
    from transformers import AutoTokenizer

    observation, sent = play[0][0][0]
    encode_text = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    phrase = encode_text(sent.removeprefix("Action: "))
    reply = encode_text(sent)
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
