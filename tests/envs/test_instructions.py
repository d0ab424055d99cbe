"""Each environment's instruction: the reply format and every command form the environment
takes, read without importing the environment (the trainer calls it)."""

import subprocess
import sys

import pytest

import envs
from envs.babyai.text import COMMAND_FORMS as BABYAI_FORMS
from envs.textcraft.game import COMMAND_FORMS as TEXTCRAFT_FORMS
from tests.conftest import REPO


@pytest.mark.parametrize("name", [k for k in envs.KINDS if k not in ("deepsearch", "webarena")])
def test_instruction_gives_the_thought_then_action_format(name):
    text = envs.instruction(name)
    lines = text.splitlines()
    assert any(line.startswith("Thought:") for line in lines)
    example = next(i for i, line in enumerate(lines) if line.startswith("Action: "))
    assert lines[example - 1].startswith("Thought: ")  # the worked example: a Thought line, then the Action line
    assert 'exactly one' in text and 'on its own line starting with "Action:"' in text


@pytest.mark.parametrize("name,forms", [("textcraft", TEXTCRAFT_FORMS), ("babyai", BABYAI_FORMS)])
def test_instruction_names_every_command_form_of_its_environment(name, forms):
    text = envs.instruction(name)
    assert [form for form in forms if form not in text] == []


def test_deepsearch_instruction_gives_think_then_one_tagged_action():
    from envs.deepsearch.env import ACTION_FORMS, parse_action

    text = envs.instruction("deepsearch")
    assert [form for form in ACTION_FORMS if form not in text] == []
    assert "<think>" in text and "exactly one action" in text and "<information>" in text
    example = text.split("For example:\n", 1)[1]
    assert example.startswith("<think>") and parse_action(example) == ("search", "author of The Silent Harbour")


def test_webarena_instruction_names_every_action_and_its_example_parses():
    from envs.webarena import actions

    text = envs.instruction("webarena")
    forms = [form.split(" [")[0] for form in actions.USAGE.split(", ")]
    assert [form for form in forms if form not in text] == []
    example = text.split("For example:\n", 1)[1]
    assert actions.parse(example) == actions.Action("type", element=34, text="kettle", enter=True)


def test_textcraft_instruction_tells_the_concrete_ingredient_rule():
    text = envs.instruction("textcraft")
    assert '"planks"' in text and "oak planks" in text and "count" in text


def test_unknown_environment_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown environment 'nope'; allowed: textcraft, babyai, sciworld, deep"):
        envs.instruction("nope")


def test_instructions_load_without_the_environments():
    code = ("import sys, envs\n"
            "assert all(envs.instruction(n) for n in envs.KINDS)\n"
            "assert envs.check_options('deepsearch', {'topk': '3'}).topk == 3\n"
            "assert envs.check_options('webarena', {'step_timeout_s': '5'}).step_timeout_s == 5\n"
            "heavy = ('minigrid', 'gymnasium', 'scienceworld', 'py4j', 'textcraft', 'bm25s', 'faiss', 'playwright')\n"
            "print(sorted(m for m in heavy if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
