"""Token-exact multi-turn with real chat templates: a BabyAI episode (the real environment,
in-process) built as the rollout manager builds it (ChatTurns around the sampled ids, the
manager's own bookkeeping) against `apply_chat_template` over the same conversation, with
SmolLM2's tokenizer and template and with the Qwen2.5 and Llama-3.1 templates, the instruction in
the first user turn or in a system turn.

The replies are not sampled by a live engine: each is the ids an engine emits for it (its tokens
then the end-of-turn token, which vLLM returns as the last sampled id), chosen to cover what an
engine can sample at a turn boundary: a plain reply, one opening with blank lines, and one in a
non-canonical split (" ba" + "ll") ending in a newline. A SmolLM2 engine could not sample the
Qwen2.5 and Llama-3.1 vocabularies anyway, and the manager appends whatever ids come back without
looking at them (tests/e2e/test_rollout_manager.py runs it against vLLM).

No installed package ships Qwen2.5's or Llama-3.1's tokenizer, so those two run their published
templates (tests/data/chat_templates/, sources in its README) over SmolLM2's BPE with their
special tokens added: the template's structure is theirs, the merges SmolLM2's."""

import difflib
import functools
import os

import pytest
from tokenizers.processors import TemplateProcessing

import envs
from agentgym_mega.rollout.manager import ChatTurns, _Live
from envs.babyai.text import BabyAIEnv
from envs.environment import Task, extract_action

TEMPLATES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "chat_templates")

# What apply_chat_template does differently from the rollout's ids, each named; the README's
# "Tokens" paragraph says why each is right.
# Our prompt piece is tokenised alone, the template's text in one piece: whitespace at the boundary
# splits another way (ChatML: the prompt's "\n" + a reply's "\n\n" -> "\n\n" + "\n"; Llama-3.1:
# "<|end_header_id|>\n\n" ends the prompt as one "\n\n" token, before a word SmolLM2's GPT-2
# pre-tokeniser makes it two).
MERGE = "bpe merge across the turn boundary"
NON_CANONICAL = "non-canonical sampled ids"  # " ba"+"ll" kept, the template re-tokenises to " ball"
TRIMMED = "sampled whitespace the template trims"  # Llama-3.1 renders content|trim
FINAL_NEWLINE = "newline after the last end-of-turn token"  # ChatML's "<|im_end|>\n": the episode ends at eos

EXPECTED = {
    "smollm2": [MERGE, NON_CANONICAL, FINAL_NEWLINE],
    "qwen2.5": [MERGE, NON_CANONICAL, FINAL_NEWLINE],
    "llama-3.1": [MERGE, TRIMMED, MERGE, NON_CANONICAL, TRIMMED],
}
END_OF_TURN = {"smollm2": "<|im_end|>", "qwen2.5": "<|im_end|>", "llama-3.1": "<|eot_id|>"}
# Each template's system turn when it is given none: it must be there exactly when the instruction is not.
DEFAULT_SYSTEM = {"smollm2": "You are a helpful AI assistant named SmolLM",
                  "qwen2.5": "You are Qwen, created by Alibaba Cloud.",
                  "llama-3.1": "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"}
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def published(smollm2: str, name: str):
    """SmolLM2's tokenizer with `name`'s chat template and special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    if name == "smollm2":
        return tok
    with open(os.path.join(TEMPLATES, f"{name}-instruct.jinja"), encoding="utf-8") as f:
        tok.chat_template = f.read()
    if name == "llama-3.1":
        tok.add_special_tokens({"additional_special_tokens": LLAMA_SPECIAL})
        tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
        # Llama-3.1's tokenizer prepends the bos itself: a path that let it would have two.
        tok.backend_tokenizer.post_processor = TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tok.bos_token_id)])
    return tok  # Qwen2.5's <|im_start|>, <|im_end|> (its eos) are SmolLM2's own


@pytest.fixture(scope="module")
def tokenizers(smollm2):
    """Each tokenizer loaded once for the module's tests (they only read it)."""
    return functools.cache(lambda name: published(smollm2, name))


@pytest.fixture(scope="module")
def episode():
    """Three turns of BabyAI task 0 (GoToRedBall): the replies' texts, the engine's ids of each
    (a function of the tokenizer), and the observations."""
    env = BabyAIEnv()
    observations = [env.reset(Task(0).id)["observation"]]
    texts = ["Thought: The red ball is ahead on my right.\nAction: turn right",
             "\n\nThought: I turned away from it.\nAction: turn left",
             "Action: go to red ball 1\n"]
    for text in texts:
        observations.append(env.step(extract_action(text))["observation"])
    env.close()

    def sampled(tok) -> list[list[int]]:
        def encode(text):
            return tok(text, add_special_tokens=False)["input_ids"]
        split = encode(texts[2][:20]) + encode(texts[2][20:])  # "...red ba" + "ll 1\n"
        assert split != encode(texts[2])  # the engine's split is not the canonical one
        return [ids + [tok.eos_token_id] for ids in (encode(texts[0]), encode(texts[1]), split)]

    return texts, sampled, observations


def rollout(turns: ChatTurns, replies: list[list[int]], observations: list[str]) -> _Live:
    """The episode's ids and mask as RolloutManager.collect builds them."""
    ep = _Live(Task(0), 0, 0, 0, len(replies))
    ep.add(turns.first(observations[0]), sampled=False)
    for i, reply in enumerate(replies):
        ep.add(reply, sampled=True, logprobs=[-1.0] * len(reply), version=0)
        if i + 1 < len(replies):  # the last observation is never answered
            ep.add(turns.after_reply(reply, observations[i + 1]), sampled=False)
    return ep


def conversation(tok, instruction: str, role: str, replies, observations) -> list[dict]:
    """The same episode as chat messages: the instruction where `role` puts it, each reply as
    the manager decodes it for the environment."""
    first = observations[0] if role == "system" else f"{instruction}\n\n{observations[0]}"
    messages = [{"role": "system", "content": instruction}] if role == "system" else []
    messages.append({"role": "user", "content": first})
    for i, reply in enumerate(replies):
        messages.append({"role": "assistant", "content": tok.decode(reply, skip_special_tokens=True)})
        if i + 1 < len(replies):
            messages.append({"role": "user", "content": observations[i + 1]})
    return messages


def differences(tok, ours: list[int], mask: list[int], theirs: list[int]) -> list[str]:
    """Every place where the template's ids differ from the rollout's, named; an unnamed one
    reads "unexplained" with both sides' text."""
    names = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, ours, theirs, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        a, b, sampled = tok.decode(ours[i1:i2]), tok.decode(theirs[j1:j2]), set(mask[i1:i2])
        at_boundary = sampled == {0, 1} or (sampled == {0} and i2 < len(mask) and mask[i2] == 1)
        if i1 == len(ours) and b == "\n":
            names.append(FINAL_NEWLINE)
        elif a == b and at_boundary:
            names.append(MERGE)
        elif a == b and sampled == {1}:
            names.append(NON_CANONICAL)
        elif tag == "delete" and not a.strip() and 1 in mask[max(i1 - 1, 0): i2 + 1]:
            names.append(TRIMMED)
        else:
            names.append(f"unexplained: {tag} rollout {a!r} template {b!r}")
    return names


@pytest.mark.parametrize("role", ["user", "system"])
@pytest.mark.parametrize("name", ["smollm2", "qwen2.5", "llama-3.1"])
def test_rollout_ids_match_the_template_but_for_named_differences(tokenizers, episode, name, role):
    tok = tokenizers(name)
    texts, sampled, observations = episode
    replies = sampled(tok)
    instruction = envs.instruction("babyai")
    ep = rollout(ChatTurns(tok, instruction, role), replies, observations)
    ids, mask = ep.ids, ep.mask

    # The sampled ids are kept exactly: the mask's runs are the replies, each ending in the
    # template's end-of-turn token (the eos the engine stopped at), and nothing else is masked.
    end_of_turn = tok.convert_tokens_to_ids(END_OF_TURN[name])
    assert tok.eos_token_id == end_of_turn
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(ids[start:i])
            start = None
    assert runs == replies and all(run[-1] == end_of_turn for run in runs)
    assert sum(mask) == sum(map(len, replies))

    # No special token twice: one bos where the template has one, no end-of-turn doubled.
    assert ids.count(tok.convert_tokens_to_ids("<|begin_of_text|>")) == (name == "llama-3.1")
    assert all(not (a == b == end_of_turn) for a, b in zip(ids, ids[1:]))

    # The instruction is where `role` sends it, and the template's default system turn only
    # without one of ours.
    text = tok.decode(ids)
    system = text[: text.index("user")]
    assert (instruction in system) == (role == "system") and instruction in text
    assert (DEFAULT_SYSTEM[name] in system) == (role == "user")

    messages = conversation(tok, instruction, role, replies, observations)
    theirs = tok.apply_chat_template(messages)
    theirs = theirs["input_ids"] if hasattr(theirs, "keys") else theirs  # transformers 5 returns an encoding
    assert [m["content"] for m in messages if m["role"] == "assistant"] == texts
    assert differences(tok, ids, mask, theirs) == EXPECTED[name]


def test_the_configured_role_reaches_the_rollout_and_an_unknown_one_is_refused(tokenizers):
    from agentgym_mega.config import load_config
    from agentgym_mega.rollout.manager import RolloutManager

    tok = tokenizers("smollm2")
    cfg = load_config(None, ["env.name=babyai", "env.instruction_role=system"])
    # No engine or env is called: from_config only builds the manager's ChatTurns.
    managed = RolloutManager.from_config(cfg, [None], None, tok)
    assert tok.decode(managed.turns.first("Your goal: x")).startswith(
        f"<|im_start|>system\n{envs.instruction('babyai')}<|im_end|>\n<|im_start|>user\nYour goal: x<|im_end|>")
    with pytest.raises(ValueError, match="instruction_role 'assistant'"):
        ChatTurns(tok, "Be brief.", "assistant")
    with pytest.raises(ValueError, match="instruction_role"):
        load_config(None, ["env.instruction_role=assistant"])


def test_a_template_that_rewrites_earlier_turns_is_refused(smollm2):
    # e.g. one that counts the turns in a header: the ids already sampled would no longer be a prefix
    tok = published(smollm2, "smollm2")
    tok.chat_template = ("{{ messages|length|string }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        ChatTurns(tok)
