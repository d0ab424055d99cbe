"""Deep Search's questions: FlashRAG JSONL files (`question`, `golden_answers`) in one id space.

Ids are contiguous per file, in the layout's order, so with FlashRAG's own files they follow
AgentGym's: train NQ (79,168), HotpotQA (90,447), then test NQ (3,610), TriviaQA (11,313), PopQA
(14,267), HotpotQA (7,405, its dev file), 2Wiki (12,576), MuSiQue (2,417), Bamboogle (125).
A task's category is its data source. Nothing is downloaded: `data_dir` points at the files.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

log = logging.getLogger(__name__)

# (source, file under data_dir, split), in AgentGym's id order; FlashRAG has no HotpotQA, 2Wiki or
# MuSiQue test answers, so their dev files are the test sets (as in Search-R1 and AgentGym).
FLASHRAG_LAYOUT = (
    ("nq", "nq/train.jsonl", "train"),
    ("hotpotqa", "hotpotqa/train.jsonl", "train"),
    ("nq", "nq/test.jsonl", "test"),
    ("triviaqa", "triviaqa/test.jsonl", "test"),
    ("popqa", "popqa/test.jsonl", "test"),
    ("hotpotqa", "hotpotqa/dev.jsonl", "test"),
    ("2wikimultihopqa", "2wikimultihopqa/dev.jsonl", "test"),
    ("musique", "musique/dev.jsonl", "test"),
    ("bamboogle", "bamboogle/test.jsonl", "test"),
)


@dataclasses.dataclass(frozen=True)
class Question:
    question: str
    golden_answers: tuple[str, ...]
    source: str
    split: str


def layout(data_dir: str) -> list[tuple[str, str, str]]:
    """(source, path, split) of every question file, in id order."""
    manifest = os.path.join(data_dir, "layout.json")
    if os.path.exists(manifest):
        with open(manifest, encoding="utf-8") as f:
            try:
                entries = json.load(f)
            except ValueError as exc:
                raise ValueError(f"{manifest}: not JSON ({exc})") from None
        bad = [e for e in entries if not _layout_entry(e)] if isinstance(entries, list) else [entries]
        if bad:
            raise ValueError(f"{manifest}: expected a list of {{\"source\", \"file\", \"split\": train|test|dev}}, "
                             f"found {bad[0]!r}")
        files = [(e["source"], os.path.join(data_dir, e["file"]), e["split"]) for e in entries]
        missing = [path for _, path, _ in files if not os.path.exists(path)]
        if missing:
            raise ValueError(f"{manifest} names files that do not exist: {missing}")
        return files
    files = [(source, os.path.join(data_dir, name), split) for source, name, split in FLASHRAG_LAYOUT
             if os.path.exists(os.path.join(data_dir, name))]
    if not files:
        raise ValueError(f"no question files in {data_dir}: expected a layout.json or FlashRAG's files "
                         f"({', '.join(name for _, name, _ in FLASHRAG_LAYOUT)})")
    absent = [name for _, name, _ in FLASHRAG_LAYOUT if not os.path.exists(os.path.join(data_dir, name))]
    if absent:
        log.warning("deepsearch: %s has no %s; ids follow the files present", data_dir, ", ".join(absent))
    return files


def _layout_entry(entry) -> bool:
    return (isinstance(entry, dict) and {"source", "file", "split"} <= set(entry)
            and entry["split"] in ("train", "test", "dev"))


def load(data_dir: str) -> list[Question]:
    """Every question of the layout, in id order; a malformed line is an error naming file and line."""
    questions = []
    for source, path, split in layout(data_dir):
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                    question, answers = item["question"], item["golden_answers"]
                    if not isinstance(question, str) or not question.strip():
                        raise ValueError("question must be a non-empty string")
                    if not (isinstance(answers, list) and answers and all(isinstance(a, str) for a in answers)):
                        raise ValueError("golden_answers must be a non-empty list of strings")
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{number}: not a FlashRAG question ({exc!r}); expected "
                                     '{"question": "...", "golden_answers": ["..."]}') from None
                questions.append(Question(question.strip(), tuple(answers), source, split))
    if not questions:
        raise ValueError(f"the question files in {data_dir} hold no question")
    return questions
