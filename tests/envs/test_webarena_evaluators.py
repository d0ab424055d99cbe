"""WebArena's evaluators: right answers pass and near misses fail for each, scores multiply across
evaluators, unjudged fuzzy references are counted, bad configs are refused at load time, and the
judge speaks OpenAI's chat-completions protocol to a real local HTTP server."""

import re

import pytest

from envs.webarena import evaluators as ev
from tests.conftest import refused_url
from tests.envs.webarena_agent import ChatServer


class FakeJudge:
    """A judge with fixed verdicts that records what it was asked (the Judge interface, no HTTP)."""

    def __init__(self, fuzzy: float = 1.0, unachievable: float = 1.0):
        self.verdicts = {"fuzzy": fuzzy, "unachievable": unachievable}
        self.asked = []

    def fuzzy(self, intent, reference, answer):
        self.asked.append(("fuzzy", intent, reference, answer))
        return self.verdicts["fuzzy"]

    def unachievable(self, intent, answer):
        self.asked.append(("unachievable", intent, answer))
        return self.verdicts["unachievable"]


def test_clean_answer_strips_space_one_pair_of_quotes_and_case():
    assert ev.clean_answer('  "Hello World" ') == "hello world"
    assert ev.clean_answer("'Pittsburgh'") == "pittsburgh"
    assert ev.clean_answer("\"'nested'\"") == "'nested'"
    assert ev.clean_answer("\"unbalanced'") == "\"unbalanced'"


def test_exact_match_accepts_quotes_and_case_but_not_extra_words():
    assert ev.exact_match('"Pittsburgh"', "pittsburgh") == 1.0
    assert ev.exact_match("PITTSBURGH ", "Pittsburgh") == 1.0
    assert ev.exact_match("Pittsburgh, PA", "Pittsburgh") == 0.0
    assert ev.exact_match("Pittsburg", "Pittsburgh") == 0.0


def test_must_include_by_substring_or_whole_tokens():
    assert ev.must_include("It costs $50.", "$5") == 1.0  # plain containment
    assert ev.must_include("It costs $50.", "$5", tokenize=True) == 0.0
    assert ev.must_include("It costs $5.", "$5", tokenize=True) == 1.0
    assert ev.must_include("There are 10 orders", "1", tokenize=True) == 0.0
    assert ev.must_include("There is 1 order", "1", tokenize=True) == 1.0
    assert ev.must_include("I live in New York City", "new york", tokenize=True) == 1.0
    assert ev.must_include("York is new", "new york", tokenize=True) == 0.0
    assert ev.must_include("it weighs 3.5 kg", "3", tokenize=True) == 0.0
    assert ev.must_include("1,000 people", "1", tokenize=True) == 0.0
    assert ev.must_include("'Apple'", "APPLE") == 1.0


def test_must_include_or_alternatives_any_one_suffices():
    assert ev.must_include("The colour is grey", "gray |OR| grey") == 1.0
    assert ev.must_include("The colour is grey", "gray |OR| grey", tokenize=True) == 1.0
    assert ev.must_include("The colour is green", "gray |OR| grey") == 0.0


def test_string_match_exact_must_include_and_their_product():
    assert ev.string_match("Pittsburgh", {"exact_match": "pittsburgh"}, "q", None) == (1.0, 0, [])
    score, unjudged, notes = ev.string_match("in Pittsburgh", {"exact_match": "pittsburgh"}, "q", None)
    assert (score, unjudged) == (0.0, 0) and "exact_match" in notes[0]
    # Several items: plain containment, every item required.
    both = {"must_include": ["red", "blue"]}
    assert ev.string_match("red and blue", both, "q", None)[0] == 1.0
    score, _, notes = ev.string_match("red and green", both, "q", None)
    assert score == 0.0 and "'blue'" in notes[0]
    assert ev.string_match("$50", {"must_include": ["$5", "0"]}, "q", None)[0] == 1.0
    # A single item: whole tokens.
    assert ev.string_match("$50", {"must_include": ["$5"]}, "q", None)[0] == 0.0
    assert ev.string_match("$5", {"must_include": ["$5"]}, "q", None)[0] == 1.0
    mixed = {"exact_match": "5", "must_include": ["5"]}
    assert ev.string_match("5", mixed, "q", None)[0] == 1.0
    assert ev.string_match("5 items", mixed, "q", None)[0] == 0.0


def test_string_match_fuzzy_asks_the_judge_for_each_reference():
    judge = FakeJudge(fuzzy=1.0)
    refs = {"fuzzy_match": ["two dogs", "a cat"]}
    assert ev.string_match("Two dogs and a cat", refs, "Which pets?", judge) == (1.0, 0, [])
    assert judge.asked == [("fuzzy", "Which pets?", "two dogs", "Two dogs and a cat"),
                           ("fuzzy", "Which pets?", "a cat", "Two dogs and a cat")]
    score, unjudged, notes = ev.string_match("a fish", refs, "Which pets?", FakeJudge(fuzzy=0.0))
    assert (score, unjudged) == (0.0, 0) and len(notes) == 2


def test_string_match_unachievable_reference():
    refs = {"fuzzy_match": "N/A"}
    judge = FakeJudge(unachievable=1.0)
    assert ev.string_match("There is no such order", refs, "Find order 9", judge)[0] == 1.0
    assert judge.asked == [("unachievable", "Find order 9", "There is no such order")]
    assert ev.string_match("Order 9 costs $3", refs, "Find order 9", FakeJudge(unachievable=0.0))[0] == 0.0
    # The marker itself needs no judge.
    assert ev.string_match('"N/A"', refs, "Find order 9", None) == (1.0, 0, [])


def test_string_match_without_judge_skips_and_counts_fuzzy_references():
    score, unjudged, notes = ev.string_match("Two dogs", {"fuzzy_match": ["two dogs", "a cat"]}, "q", None)
    assert (score, unjudged) == (0.0, 2) and "no judge" in notes[0]
    assert ev.string_match("no such order", {"fuzzy_match": "N/A"}, "q", None)[:2] == (0.0, 1)
    # The other parts still decide.
    refs = {"must_include": ["dogs"], "fuzzy_match": ["two dogs"]}
    assert ev.string_match("Two dogs", refs, "q", None)[:2] == (1.0, 1)
    assert ev.string_match("Two cats", refs, "q", None)[:2] == (0.0, 1)


def test_url_match_host_path_and_query_parameters():
    ref = "http://shop:7770/catalogsearch/result/?q=shoes&cat=3"
    assert ev.url_match("http://shop:7770/catalogsearch/result/?cat=3&q=shoes", ref) == 1.0
    assert ev.url_match("http://shop:7770/catalogsearch/result?q=shoes&cat=3&page=2", ref) == 1.0
    assert ev.url_match("https://shop:7770/catalogsearch/result/?q=shoes&cat=3#top", ref) == 1.0
    assert ev.url_match("http://shop:7770/catalogsearch/result/?q=shoes", ref) == 0.0
    assert ev.url_match("http://shop:7770/catalogsearch/result/?q=boots&cat=3", ref) == 0.0
    assert ev.url_match("http://shop:7770/catalogsearch/other/?q=shoes&cat=3", ref) == 0.0
    assert ev.url_match("http://shop:7780/catalogsearch/result/?q=shoes&cat=3", ref) == 0.0
    assert ev.url_match("http://other:7770/catalogsearch/result/?q=shoes&cat=3", ref) == 0.0


def test_url_match_trailing_slash_quoting_and_default_port():
    assert ev.url_match("http://wiki/a/b/", "http://wiki/a/b") == 1.0
    assert ev.url_match("http://wiki/", "http://wiki") == 1.0
    assert ev.url_match("http://wiki/New%20York", "http://wiki/New York") == 1.0
    assert ev.url_match("http://wiki:80/a", "http://wiki/a") == 1.0
    assert ev.url_match("http://wiki/a/b/c", "http://wiki/a/b") == 0.0
    assert ev.url_match("http://wiki/search?q=", "http://wiki/search?q=") == 1.0
    assert ev.url_match("http://wiki/search", "http://wiki/search?q=") == 0.0


def test_url_match_or_alternatives_each_with_its_own_query():
    ref = "http://git/a/-/issues?state=open |OR| http://git/b"
    assert ev.url_match("http://git/a/-/issues?state=open", ref) == 1.0
    assert ev.url_match("http://git/b?state=closed", ref) == 1.0
    assert ev.url_match("http://git/a/-/issues?state=closed", ref) == 0.0


def test_url_match_refuses_unknown_note():
    with pytest.raises(ValueError, match="url_note"):
        ev.url_match("http://a/", "http://a/", note="EXACT")


PAGES = {
    ("last", ""): "<html><body><h1>Order #12 &amp; more</h1></body></html>",
    ("http://shop/cart", "document.querySelector('.total').outerText"): " $42.00 ",
    ("http://shop/review", "document.querySelector('.review').outerText"): "Great product, would buy again",
}


def fetch(url, locator):
    return PAGES[(url, locator)]


def test_program_html_exact_and_must_include_per_target():
    exact = {"url": "http://shop/cart", "locator": "document.querySelector('.total').outerText",
             "required_contents": {"exact_match": "$42.00"}}
    includes = {"url": "last", "locator": "", "required_contents": {"must_include": ["order #12 & more", "<h1>"]}}
    assert ev.program_html([exact, includes], fetch) == (1.0, [])
    near = dict(exact, required_contents={"exact_match": "$42"})
    score, notes = ev.program_html([near, includes], fetch)
    assert score == 0.0 and len(notes) == 1 and "$42" in notes[0]
    missing = dict(includes, required_contents={"must_include": ["order #12", "order #13"]})
    assert ev.program_html([exact, missing], fetch)[0] == 0.0


def test_program_html_or_alternatives_and_plain_containment():
    review = {"url": "http://shop/review", "locator": "document.querySelector('.review').outerText"}
    assert ev.program_html([dict(review, required_contents={"must_include": ["bad |OR| great"]})], fetch)[0] == 1.0
    assert ev.program_html([dict(review, required_contents={"must_include": ["bad |OR| awful"]})], fetch)[0] == 0.0
    # No tokenizing here, as in WebArena: "produc" is inside "product".
    assert ev.program_html([dict(review, required_contents={"must_include": ["produc"]})], fetch)[0] == 1.0


def test_program_html_fetch_failure_scores_zero_with_a_note():
    def broken(url, locator):
        raise TimeoutError("page did not load")

    target = {"url": "http://shop/cart", "locator": "", "required_contents": {"must_include": ["x"]}}
    score, notes = ev.program_html([target], broken)
    assert score == 0.0 and "page did not load" in notes[0]
    assert ev.program_html([], fetch)[0] == 0.0


def test_program_html_null_locator_result_is_empty_text():
    target = {"url": "last", "locator": "document.querySelector('.none')", "required_contents": {"exact_match": ""}}
    assert ev.program_html([target], lambda url, locator: None)[0] == 1.0


CONFIG = {
    "eval_types": ["string_match", "url_match", "program_html"],
    "reference_answers": {"must_include": ["12"], "fuzzy_match": ["order twelve"]},
    "reference_url": "http://shop/cart",
    "url_note": "GOLD in PRED",
    "program_html": [{"url": "http://shop/cart", "locator": "document.querySelector('.total').outerText",
                      "required_contents": {"must_include": ["42"]}}],
    "string_note": "",
}


def test_evaluate_multiplies_every_listed_evaluator():
    out = ev.evaluate(CONFIG, "Which order?", "Order 12", "http://shop/cart/", fetch, FakeJudge())
    assert out == ev.Verdict(score=1.0, parts={"string_match": 1.0, "url_match": 1.0, "program_html": 1.0},
                             unjudged=0, notes=[])
    out = ev.evaluate(CONFIG, "Which order?", "Order 12", "http://shop/checkout", fetch, FakeJudge())
    assert out.score == 0.0 and out.parts["url_match"] == 0.0 and out.parts["string_match"] == 1.0
    assert len(out.notes) == 1 and "url_match" in out.notes[0]
    out = ev.evaluate(CONFIG, "Which order?", "Order 12", "http://shop/cart", fetch, FakeJudge(fuzzy=0.0))
    assert out.score == 0.0 and out.parts == {"string_match": 0.0, "url_match": 1.0, "program_html": 1.0}


def test_evaluate_counts_unjudged_and_runs_only_listed_types():
    out = ev.evaluate(CONFIG, "Which order?", "Order 12", "http://shop/cart", fetch, None)
    assert (out.score, out.unjudged) == (1.0, 1) and "no judge" in out.notes[0]
    only_url = {"eval_types": ["url_match"], "reference_answers": None, "reference_url": "http://shop/cart",
                "program_html": []}
    out = ev.evaluate(only_url, "q", "anything", "http://shop/cart", None, None)
    assert out.parts == {"url_match": 1.0} and out.score == 1.0


def test_check_eval_config_accepts_webarena_shapes():
    ev.check_eval_config(CONFIG, "task 0")
    ev.check_eval_config({"eval_types": ["string_match"], "reference_answers": {"fuzzy_match": "N/A"},
                          "reference_url": "", "program_html": [], "string_note": "cannot"}, "task 1")
    ev.check_eval_config({"eval_types": ["program_html"], "reference_answers": None, "reference_url": "",
                          "program_html": [{"url": "last", "locator": "",
                                            "required_contents": {"exact_match": "done"}}]}, "task 2")


@pytest.mark.parametrize("change, field", [
    ({"eval_types": []}, "eval.eval_types"),
    ({"eval_types": ["string_match", "html_match"]}, "eval.eval_types"),
    ({"reference_answers": None}, "eval.reference_answers"),
    ({"reference_answers": {}}, "eval.reference_answers"),
    ({"reference_answers": {"regex": "x"}}, "eval.reference_answers.regex"),
    ({"reference_answers": {"must_include": []}}, "eval.reference_answers.must_include"),
    ({"reference_answers": {"must_include": ["a", " "]}}, "eval.reference_answers.must_include"),
    ({"reference_answers": {"exact_match": ["a"]}}, "eval.reference_answers.exact_match"),
    ({"reference_answers": {"fuzzy_match": "NA"}}, "eval.reference_answers.fuzzy_match"),
    ({"reference_url": ""}, "eval.reference_url"),
    ({"url_note": "EXACT"}, "eval.url_note"),
    ({"program_html": []}, "eval.program_html"),
    ({"program_html": [{"url": "last", "required_contents": {"exact_match": "x"}}]}, "eval.program_html[0].locator"),
    ({"program_html": [{"url": "last", "locator": ""}]}, "eval.program_html[0].required_contents"),
    ({"program_html": [{"url": "last", "locator": "", "required_contents": {"must_include": "x"}}]},
     "eval.program_html[0].required_contents.must_include"),
    ({"program_html": [{"url": "last", "locator": "", "required_contents": {"regex": "x"}}]},
     "eval.program_html[0].required_contents"),
    ({"program_html": [{"url": "last", "locator": "", "required_contents": {"exact_match": "x"},
                        "prep_actions": ["document.querySelector('a').click()"]}]},
     "eval.program_html[0].prep_actions"),
])
def test_check_eval_config_names_the_task_and_the_field(change, field):
    with pytest.raises(ValueError) as raised:
        ev.check_eval_config({**CONFIG, **change}, "task 12")
    assert str(raised.value).startswith(f"task 12: {field} ")


@pytest.mark.parametrize("key, value", [
    ("url", "func:shopping_get_latest_order_url()"),
    ("locator", "func:shopping_get_sku_latest_review_author('B0001')"),
])
def test_check_eval_config_refuses_webarena_helper_functions(key, value):
    target = {"url": "last", "locator": "", "required_contents": {"must_include": ["x"]}, key: value}
    with pytest.raises(ValueError, match=rf"task 7: eval.program_html\[0\].{key} .*not supported.*admin"):
        ev.check_eval_config({**CONFIG, "program_html": [target]}, "task 7")


@pytest.fixture
def chat():
    server = ChatServer()
    yield server
    server.close()


def test_judge_request_follows_the_chat_completions_protocol(chat):
    judge = ev.Judge(chat.url + "/", "grader-7b", api_key="sk-test", timeout_s=5)
    assert judge.fuzzy("How many orders?", "12", "There are twelve orders") == 1.0
    [request] = chat.requests
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["Authorization"] == "Bearer sk-test"
    body = request["body"]
    assert body["model"] == "grader-7b" and body["temperature"] == 0 and 0 < body["max_tokens"] <= 64
    system, user = body["messages"]
    assert (system["role"], user["role"]) == ("system", "user")
    for shown in ("How many orders?", "12", "There are twelve orders"):
        assert shown in user["content"]


def test_judge_without_key_sends_no_authorization(chat):
    ev.Judge(chat.url, "m", timeout_s=5).fuzzy("q", "r", "a")
    assert "Authorization" not in chat.requests[0]["headers"]


@pytest.mark.parametrize("reply, score", [
    ("correct", 1.0), ("Correct.", 1.0), ("**correct**", 1.0), ("The answer is correct", 1.0),
    ("incorrect", 0.0), ("Incorrect.", 0.0), ("partially correct", 0.0), ("not correct", 0.0),
])
def test_judge_fuzzy_verdicts(chat, reply, score):
    chat.reply = reply
    assert ev.Judge(chat.url, "m", timeout_s=5).fuzzy("q", "r", "a") == score


def test_judge_unachievable_verdicts(chat):
    judge = ev.Judge(chat.url, "m", timeout_s=5)
    chat.reply = "Yes"
    assert judge.unachievable("Find order 9", "No such order exists") == 1.0
    assert "Find order 9" in chat.requests[0]["body"]["messages"][1]["content"]
    assert "No such order exists" in chat.requests[0]["body"]["messages"][1]["content"]
    chat.reply = "no."
    assert judge.unachievable("Find order 9", "It costs $3") == 0.0


@pytest.mark.parametrize("reply", ["maybe", "", "I cannot tell"])
def test_judge_unreadable_verdict_is_an_error(chat, reply):
    chat.reply = reply
    with pytest.raises(ev.JudgeError, match="verdict"):
        ev.Judge(chat.url, "m", timeout_s=5).fuzzy("q", "r", "a")
    with pytest.raises(ev.JudgeError, match="verdict"):
        ev.Judge(chat.url, "m", timeout_s=5).unachievable("q", "a")


def test_judge_http_error_names_the_url_and_status(chat):
    chat.status = 500
    with pytest.raises(ev.JudgeError, match=r"127\.0\.0\.1.*/v1/chat/completions.*HTTP 500.*model crashed"):
        ev.Judge(chat.url, "m", timeout_s=5).fuzzy("q", "r", "a")


def test_judge_wrong_base_url_is_an_error(chat):
    with pytest.raises(ev.JudgeError, match="HTTP 404"):
        ev.Judge(chat.url.removesuffix("/v1"), "m", timeout_s=5).fuzzy("q", "r", "a")


@pytest.mark.parametrize("raw", [b"<html>gateway</html>", b'{"choices": []}', b'{"error": "busy"}',
                                 b'{"choices": [{"message": {"content": null}}]}'])
def test_judge_malformed_reply_is_an_error(chat, raw):
    chat.raw = raw
    with pytest.raises(ev.JudgeError, match=r"/v1/chat/completions: reply is not a chat completion"):
        ev.Judge(chat.url, "m", timeout_s=5).fuzzy("q", "r", "a")


def test_judge_reads_at_most_a_megabyte_of_reply(chat):
    chat.raw = b" " * (2 << 20) + b"{}"
    with pytest.raises(ev.JudgeError, match="reply larger than"):
        ev.Judge(chat.url, "m", timeout_s=5).fuzzy("q", "r", "a")


def test_judge_closed_port_is_an_error():
    with refused_url() as url:
        with pytest.raises(ev.JudgeError, match=re.escape(url) + "/v1/chat/completions.*request failed"):
            ev.Judge(f"{url}/v1", "m", timeout_s=5).fuzzy("q", "r", "a")


def test_evaluate_propagates_judge_errors(chat):
    chat.status = 503
    config = {"eval_types": ["string_match"], "reference_answers": {"fuzzy_match": ["twelve"]}}
    with pytest.raises(ev.JudgeError, match="HTTP 503"):
        ev.evaluate(config, "q", "12", "http://a/", None, ev.Judge(chat.url, "m", timeout_s=5))
