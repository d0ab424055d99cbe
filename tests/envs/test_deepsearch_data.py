"""The generated Deep Search world (`envs/deepsearch/synthetic.py`, committed in
`envs/deepsearch/data`) and the scripted agent's reading of observations written by hand."""

import json
import os
import re
import string

import pytest

from envs.deepsearch import synthetic
from tests.envs.deepsearch_agent import ScriptedSearchAgent, extract, parse_question

DATA = synthetic.DATA_DIR
FILES = ["corpus.jsonl", "layout.json"] + [entry["file"] for entry in synthetic.LAYOUT]


def _rows(name: str) -> list[dict]:
    with open(os.path.join(DATA, name), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def corpus() -> dict[str, str]:
    return {row["id"]: row["contents"] for row in _rows("corpus.jsonl")}


@pytest.fixture(scope="module")
def questions() -> dict[str, list[dict]]:
    return {entry["file"]: _rows(entry["file"]) for entry in synthetic.LAYOUT}


def _all(questions: dict[str, list[dict]]) -> list[dict]:
    return [q for rows in questions.values() for q in rows]


def _normalize(text: str) -> str:  # SQuAD's, as the environment scores answers
    text = re.sub(r"\b(a|an|the)\b", " ", text.lower().translate(str.maketrans("", "", string.punctuation)))
    return " ".join(text.split())


def test_committed_files_are_what_the_generator_writes(tmp_path):
    counts = synthetic.generate(str(tmp_path))
    written = sorted(os.path.relpath(os.path.join(d, f), tmp_path) for d, _, fs in os.walk(tmp_path) for f in fs)
    assert written == sorted(FILES)
    for name in FILES:
        with open(tmp_path / name, "rb") as new, open(os.path.join(DATA, name), "rb") as committed:
            assert new.read() == committed.read(), f"{name} differs: rerun python -m envs.deepsearch.synthetic"
    assert counts == {"passages": len(_rows("corpus.jsonl")), **{e["file"]: len(_rows(e["file"]))
                                                                for e in synthetic.LAYOUT}}
    assert sum(os.path.getsize(os.path.join(DATA, name)) for name in FILES) < 2 * 2**20
    with open(os.path.join(DATA, "layout.json")) as f:
        assert json.load(f) == synthetic.LAYOUT


def test_passages_have_unique_ids_and_distinct_invented_titles(corpus):
    assert 2000 <= len(corpus) <= 4000
    assert all(isinstance(pid, str) for pid in corpus)  # the dict would have merged a repeated id
    assert len(corpus) == len(_rows("corpus.jsonl"))
    titles = [contents.split("\n", 1)[0] for contents in corpus.values()]
    assert len({_normalize(t) for t in titles}) == len(titles)
    assert not any(word.lower() in ("a", "an", "the") for t in titles for word in t.split())
    for contents in corpus.values():
        title, text = contents.split("\n", 1)
        assert title and "\n" not in text and 2 <= len(re.findall(r"\.(?= |$)", text)) <= 5, contents


def test_questions_are_well_formed_and_their_hops_resolve(corpus, questions):
    rows = _all(questions)
    assert len({q["id"] for q in rows}) == len(rows)
    for entry in synthetic.LAYOUT:
        for q in questions[entry["file"]]:
            assert re.fullmatch(rf"{entry['split']}_\d+", q["id"])
            hops = q["metadata"]["hops"]
            assert q["metadata"]["type"] == entry["source"] and len(hops) == (1 if entry["source"] == "single" else 2)
            assert all(hop["passage_id"] in corpus for hop in hops)
            # every golden answer is stated in the gold passage of the last hop
            last = corpus[hops[-1]["passage_id"]].split("\n", 1)[1]
            assert all(answer in last for answer in q["golden_answers"]), q
            assert hops[-1]["answer"] == q["golden_answers"][0]


def test_twohop_bridges_through_hop_one_answer(corpus, questions):
    for q in questions["twohop/train.jsonl"] + questions["twohop/test.jsonl"]:
        first, second = q["metadata"]["hops"]
        assert first["answer"] in corpus[first["passage_id"]]
        assert first["answer"] in second["query"]
        assert corpus[second["passage_id"]].split("\n", 1)[0] == first["answer"]  # the bridge's own passage


def test_test_questions_share_no_entity_and_relation_with_train(questions):
    def keys(rows):
        return {(hop["passage_id"], hop["relation"]) for q in rows for hop in q["metadata"]["hops"]}

    train = questions["single/train.jsonl"] + questions["twohop/train.jsonl"]
    test = questions["single/test.jsonl"] + questions["twohop/test.jsonl"]
    assert not keys(train) & keys(test)
    assert not {q["question"] for q in train} & {q["question"] for q in test}
    assert len({q["question"] for q in train}) == len(train) and len({q["question"] for q in test}) == len(test)


def test_agent_recognises_every_generated_question_and_searches_its_first_hop(corpus, questions):
    agent = ScriptedSearchAgent()
    for q in _all(questions):
        subject, chain = parse_question(q["question"])
        hops = q["metadata"]["hops"]
        assert chain == tuple(hop["relation"] for hop in hops), q["question"]
        assert subject == corpus[hops[0]["passage_id"]].split("\n", 1)[0]
        reply = agent.reply(q["question"], [f"Question: {q['question']}"])
        assert re.fullmatch(r"<think>[^<]+</think>\n<search>(.+)</search>", reply)[1] == hops[0]["query"]


def _information(*docs: tuple[str, str]) -> str:
    """A search's observation, as the environment writes it."""
    lines = "".join(f"Doc {i}(Title: {title}) {text}\n" for i, (title, text) in enumerate(docs, 1))
    return f"<information>{lines}</information>"


# Hand-written passages in the corpus's own sentence forms: the gold one is Doc 2, among distractors
# that name the same people, cities and years.
FOUNDER = ("Kelvane Oriss", "Kelvane Oriss was born in 1843 in the city of Tarvenek. Oriss worked as an engineer. "
           "In 1873, Oriss founded Oriveth Lines. Oriss died in Morvask in 1911.")
NAMESAKE = ("Kelvane Durck", "Kelvane Durck was born in Belkarn in 1840. Durck worked as a lawyer.")
COMPANY = ("Oriveth Lines", "Oriveth Lines, a shipping company, is headquartered in Sarnek. Oriveth Lines was "
           "founded in 1873 by Kelvane Oriss. Its main competitor is Brelmar Works.")
RIVAL = ("Brelmar Works", "Brelmar Works is a steel company headquartered in Tarvenek. Brelmar Works was founded "
         "by Tolvane Aress in 1850.")
FESTIVAL = ("Gronjeth Festival", "The Gronjeth Festival was held in Tarvenek in 1899. Participants included "
            "Kelvane Oriss and Oriveth Lines.")


def _answer(reply: str) -> str:
    return re.fullmatch(r"<think>[^<]+</think>\n<answer>(.+)</answer>", reply)[1]


@pytest.mark.parametrize("question, expected", [
    ("Where was Kelvane Oriss born?", "Tarvenek"),  # not where he died, nor his namesake's city
    ("In what year was Kelvane Oriss born?", "1843"),
    ("In which city did Kelvane Oriss die?", "Morvask"),
])
def test_agent_reads_the_gold_passage_among_distractors(question, expected):
    observations = [f"Question: {question}", _information(NAMESAKE, FOUNDER, FESTIVAL)]
    assert _answer(ScriptedSearchAgent().reply(question, observations)) == expected


def test_agent_answers_a_twohop_question_through_the_bridge():
    question = "In which city was the founder of Oriveth Lines born?"
    agent, observations = ScriptedSearchAgent(), [f"Question: {question}"]
    assert agent.reply(question, observations).endswith("<search>Oriveth Lines founded by</search>")
    observations.append(_information(RIVAL, COMPANY, FESTIVAL))
    assert agent.reply(question, observations).endswith("<search>Kelvane Oriss born</search>")
    observations.append(_information(NAMESAKE, FOUNDER, COMPANY))
    assert _answer(agent.reply(question, observations)) == "Tarvenek"


def test_agent_reformulates_once_then_gives_up():
    question = "Who founded Oriveth Lines?"
    agent, observations = ScriptedSearchAgent(), [f"Question: {question}", _information(RIVAL, NAMESAKE, FESTIVAL)]
    assert agent.reply(question, observations).endswith("<search>Oriveth Lines</search>")
    assert _answer(agent.reply(question, observations + [_information(COMPANY)])) == "Kelvane Oriss"
    observations.append("<information>No passage matched the query.</information>")
    assert _answer(agent.reply(question, observations)) == "unknown"


def test_agent_gives_its_next_candidate_after_a_wrong_answer():
    question = "What is the currency of Ostrevia?"
    own = ("Ostrevia", "The capital of Ostrevia is Tarvenek. The currency of Ostrevia is the Tovar florin.")
    other = ("Velmark", "Velmark borders Ostrevia and Kraia. Ostrevia uses the Dunel crown as its currency.")
    observations = [f"Question: {question}", _information(other, own)]
    assert _answer(ScriptedSearchAgent().reply(question, observations)) == "Tovar florin"  # its own passage first
    observations.append('Your answer "Tovar florin" is not correct. Search for more information, or give another '
                        "answer.")
    assert _answer(ScriptedSearchAgent().reply(question, observations)) == "Dunel crown"


def test_agent_reads_another_passage_only_by_the_full_name():
    # In its own passage a person goes by surname; elsewhere "Oriss" alone may be someone else.
    assert extract("birth_city", "Kelvane Oriss", [("Marel Oriss", "Oriss was born in Velk in 1800.")]) == []
    assert extract("birth_city", "Kelvane Oriss", [FOUNDER]) == ["Tarvenek"]
    with pytest.raises(ValueError, match="not a question"):
        parse_question("Who is the best?")
