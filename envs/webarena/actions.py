"""WebArena's id-based action space, parsed from a model reply.

The action is the first block in triple backticks (AgentGym's webarena server reads the reply
that way); a reply that is nothing but an action (`click [12]`, as a scripted client sends it) is
taken as it is. Forms, each parameter in square brackets:

    click [id]   hover [id]   type [id] [text] [0|1]   press [key_comb]   scroll [up|down]
    new_tab   tab_focus [tab_index]   close_tab   goto [url]   go_back   go_forward   stop [answer]

`type` presses Enter after the text unless its last parameter is 0. Anything else raises
`BadAction` with a message the environment shows the model.
"""

from __future__ import annotations

import dataclasses
import re

_FENCED = re.compile(r"```(.*?)```", re.DOTALL)
_FORMS = {
    "click": re.compile(r"click\s*\[(\d+)\]"),
    "hover": re.compile(r"hover\s*\[(\d+)\]"),
    "type": re.compile(r"type\s*\[(\d+)\]\s*\[(.*?)\](?:\s*\[([01])\])?", re.DOTALL),
    "press": re.compile(r"press\s*\[(.+)\]"),
    "scroll": re.compile(r"scroll\s*\[(?:direction\s*=\s*)?(up|down)\]", re.IGNORECASE),
    "new_tab": re.compile(r"new_tab"),
    "tab_focus": re.compile(r"tab_focus\s*\[(\d+)\]"),
    "close_tab": re.compile(r"close_tab"),
    "goto": re.compile(r"goto\s*\[(.+)\]"),
    "go_back": re.compile(r"go_back"),
    "go_forward": re.compile(r"go_forward"),
    "stop": re.compile(r"stop(?:\s*\[(.*)\])?", re.DOTALL),
}
USAGE = ("click [id], hover [id], type [id] [text] [0|1], press [key_comb], scroll [up|down], new_tab, "
         "tab_focus [tab_index], close_tab, goto [url], go_back, go_forward, stop [answer]")


class BadAction(ValueError):
    """A reply holding no action of the action space; the message says what to send."""


@dataclasses.dataclass(frozen=True)
class Action:
    name: str
    element: int | None = None
    text: str = ""
    enter: bool = True

    def __str__(self) -> str:
        if self.name == "type":
            return f"type [{self.element}] [{self.text}] [{int(self.enter)}]"
        if self.element is not None:
            return f"{self.name} [{self.element}]"
        return f"{self.name} [{self.text}]" if self.text or self.name == "stop" else self.name


def parse(reply: str) -> Action:
    fenced = _FENCED.search(reply)
    text = (fenced.group(1) if fenced else reply).strip()
    name = text.split("[", 1)[0].split(None, 1)[0].lower() if text else ""
    form = _FORMS.get(name)
    match = form.fullmatch(text) if form else None
    if match is None:
        if not fenced and name not in _FORMS:
            raise BadAction("No action found: end your reply with one action inside triple backticks, "
                            f"e.g. ```click [12]```. Actions: {USAGE}.")
        raise BadAction(f"{text[:200]!r} is not a valid action. Actions: {USAGE}.")
    groups = match.groups()
    if name in ("click", "hover"):
        return Action(name, element=int(groups[0]))
    if name == "type":
        return Action(name, element=int(groups[0]), text=groups[1], enter=groups[2] != "0")
    if name == "tab_focus":
        return Action(name, element=int(groups[0]))
    if name == "scroll":
        return Action(name, text=groups[0].lower())
    if name in ("press", "goto", "stop"):
        return Action(name, text=(groups[0] or "").strip())
    return Action(name)
