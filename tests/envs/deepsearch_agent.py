"""A scripted Deep Search agent for the generated world of `envs.deepsearch.synthetic`.

It reads only the question and the observations: it recognises the question's phrasing (two-hop
phrasings first, since "the founder of X" would also pass as the subject of a single-hop one),
searches the relation's scripted query, reads the answer out of the passages with the corpus's own
sentence templates, searches again with the bridge entity for a two-hop question, and answers.
When no passage states the fact it searches once more with the subject's name alone; after a wrong
answer it gives the next candidate it read.
"""

from __future__ import annotations

import re

from envs.deepsearch.synthetic import RELATIONS, SENTENCES, TWOHOP_QUESTIONS

NAME = r"[A-Z][a-z]+(?: [A-Z][a-z]+)*"  # every invented name: capitalised words
ANSWER_PATTERNS = {"year": r"\d{4}", "currency": r"[A-Z][a-z]+ [a-z]+"}  # "Tovar florin"
DOC = re.compile(r"^Doc \d+\(Title: (.*?)\) (.*)$", re.MULTILINE)


def _pattern(template: str, slots: dict[str, str]) -> str:
    """The template as a regex: literal text escaped, `{slot}` as slots[slot], else any text within
    one sentence (a year slot as four digits, so a year never passes for a city)."""
    parts = re.split(r"\{(\w+)\}", template)
    return "".join(re.escape(part) if i % 2 == 0 else
                   slots.get(part, r"\d{4}" if part.endswith("_year") else r"[^.]+?") for i, part in enumerate(parts))


def _question(phrasing: str) -> re.Pattern:
    return re.compile("^" + _pattern(phrasing, {"e": "(?P<e>.+)", "kind": "[a-z]+"}) + "$")


# (regex, relations in hop order); two-hop first.
QUESTION_PATTERNS = ([(_question(p), chain) for chain, phrasings in TWOHOP_QUESTIONS.items() for p in phrasings]
                     + [(_question(p), (name,)) for name, relation in RELATIONS.items() for p in relation.questions])


def parse_question(question: str) -> tuple[str, tuple[str, ...]]:
    """(subject, relations in hop order) of a generated question."""
    for regex, chain in QUESTION_PATTERNS:
        match = regex.match(question.strip())
        if match:
            return match["e"], chain
    raise ValueError(f"not a question of envs.deepsearch.synthetic's templates: {question!r}")


def parse_docs(observation: str) -> list[tuple[str, str]]:
    """(title, text) of each passage in an `<information>` observation; none in any other."""
    if not observation.startswith("<information>"):
        return []
    return DOC.findall(observation.removeprefix("<information>"))


def extract(relation: str, subject: str, docs: list[tuple[str, str]]) -> list[str]:
    """The answers the passages state for (subject, relation), the subject's own passage first.
    There a person is also named by surname alone; elsewhere only the full name counts, so another
    "X Group" never passes for "Staix Group"."""
    obj = f"(?P<o>{ANSWER_PATTERNS.get(RELATIONS[relation].answer, NAME)})"
    templates = [t for kind in SENTENCES.values() for _, variants in kind for t in variants
                 if "{" + relation + "}" in t]
    own = [text for title, text in docs if title.casefold() == subject.casefold()]
    others = [text for title, text in docs if title.casefold() != subject.casefold()]
    names = [subject, subject.split()[-1]] if len(subject.split()) > 1 else [subject]
    found: list[str] = []
    for texts, subject_names in ((own, names), (others, [subject])):
        s = r"\b(?:" + "|".join(map(re.escape, subject_names)) + ")"
        regexes = [re.compile(_pattern(t, {"s": s, relation: obj})) for t in templates]
        for text in texts:
            for regex in regexes:
                found += [m["o"] for m in regex.finditer(text) if m["o"] not in found]
    return found


class ScriptedSearchAgent:
    """`reply(question, observations)`: the next whole reply, replaying its own earlier decisions
    from the observations (observations[0] is the one after reset), so it keeps no state."""

    def reply(self, question: str, observations: list[str]) -> str:
        subject, chain = parse_question(question)
        results = iter(observations[1:])  # what each earlier reply got back, in order
        candidates: list[str] = []
        for hop, relation in enumerate(chain):
            want = f"the {relation.replace('_', ' ')} of {subject}"
            queries = [(RELATIONS[relation].query.format(s=subject), f"I need {want}."),
                       (subject, f"The passages do not state {want}; I will search for {subject} alone.")]
            for query, thought in queries:
                result = next(results, None)
                if result is None:
                    return f"<think>{thought}</think>\n<search>{query}</search>"
                candidates = extract(relation, subject, parse_docs(result))
                if candidates:
                    break
            if not candidates:
                return "<think>No passage states it.</think>\n<answer>unknown</answer>"
            if hop < len(chain) - 1:
                subject = candidates[0]
        wrong = sum(1 for _ in results)  # every later observation answered a wrong answer
        answer = candidates[min(wrong, len(candidates) - 1)]
        return f"<think>The passage gives {want}: {answer}.</think>\n<answer>{answer}</answer>"
