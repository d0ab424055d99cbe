"""The shipped Harbor Goods shop over plain HTTP (no browser), and its WebArena tasks.

Pages, search, sorting, the cart, checkout, per-cookie sessions, the caps and the slow page are
checked against expectations computed here from catalog.json, not from the server's own code.
Every task's reference answer is recomputed from the catalogue, and every plan is replayed over
HTTP (links followed by their text, forms submitted by their buttons' text), so a renamed link or
button, a wrong price, an answer not on the page a plan reads it from, or a url/program_html
reference the plan does not reach fails here. (The plans' regexes read Chromium's accessibility
tree, which only the browser tests have.)
"""

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.parse
from decimal import ROUND_HALF_UP, Decimal
from html import unescape
from html.parser import HTMLParser

import pytest
import requests

from envs.webarena.site.server import Limits, start_site
from tests.conftest import REPO

SITE = os.path.join(REPO, "envs", "webarena", "site")
with open(os.path.join(SITE, "catalog.json"), encoding="utf-8") as f:
    DATA = json.load(f, parse_float=Decimal)
with open(os.path.join(SITE, "tasks.json"), encoding="utf-8") as f:
    TASKS = json.load(f)
PRODUCTS = {p["name"]: p for p in DATA["products"]}
BY_ID = {p["id"]: p for p in DATA["products"]}
ORDERS = {o["number"]: o for o in DATA["orders"]}
SLUGS = {c["name"]: c["slug"] for c in DATA["categories"]}
NEXT_ORDER = f"{max(int(n) for n in ORDERS) + 1:06d}"


def money(amount: Decimal) -> str:
    return f"${amount:,.2f}"


def price(product: dict) -> Decimal:
    return Decimal(product["price"])


def rating(product: dict) -> Decimal | None:
    marks = [r["rating"] for r in product["reviews"]]
    return (Decimal(sum(marks)) / len(marks)).quantize(Decimal("0.1"), ROUND_HALF_UP) if marks else None


def order_total(order: dict) -> Decimal:
    return sum((price(BY_ID[i["product_id"]]) * i["qty"] for i in order["items"]), Decimal(0))


def in_category(name: str) -> list[dict]:
    return [p for p in DATA["products"] if p["category"] == SLUGS[name]]


@pytest.fixture(scope="module")
def site():
    server, url = start_site()
    yield url
    server.shutdown()


class Page(HTMLParser):
    """A page's links (text, href) and forms (action, method, fields, aria-labelled inputs, buttons)."""

    def __init__(self, text: str):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self.forms: list[dict] = []
        self._link = self._button = None
        self._in_form = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "a":
            self._link = [a.get("href"), ""]
        elif tag == "form":
            self._in_form = True
            self.forms.append({"action": a.get("action", ""), "method": a.get("method", "get").lower(), "fields": {},
                               "inputs": {}, "buttons": []})
        elif tag == "input" and self._in_form:
            form = self.forms[-1]
            if "name" in a:
                form["fields"][a["name"]] = a.get("value", "")
            if "aria-label" in a:
                form["inputs"][a["aria-label"]] = (a.get("type"), a.get("name"))
        elif tag == "button":
            self._button = ""

    def handle_data(self, data):
        if self._link is not None:
            self._link[1] += data
        if self._button is not None:
            self._button += data

    def handle_endtag(self, tag):
        if tag == "a" and self._link is not None:
            self.links.append((self._link[1].strip(), self._link[0]))
            self._link = None
        elif tag == "button" and self._button is not None:
            self.forms[-1]["buttons"].append(self._button.strip())
            self._button = None
        elif tag == "form":
            self._in_form = False


def element_text(html: str, element_id: str) -> str | None:
    """An element's text, tags as spaces (close enough to outerText for these checks)."""
    found = re.search(rf'<(\w+)[^>]*\bid="{element_id}"[^>]*>(.*?)</\1>', html, re.S)
    return None if found is None else " ".join(unescape(re.sub(r"<[^>]+>", " ", found.group(2))).split())


def product_rows(html: str) -> list[tuple[str, str, str]]:
    """(name, price, rating) of each row of a product table."""
    table = re.search(r'<table id="products">(.*?)</table>', html, re.S)
    assert table, "no product table"
    return re.findall(r'<tr><td><a href="/product/\d+">(.*?)</a></td><td>(.*?)</td><td>(.*?)</td></tr>',
                      unescape(table.group(1)))


# -- pages --------------------------------------------------------------------------------------

def test_every_page_has_the_header_and_answers_200(site):
    s = requests.Session()
    for path in ["/", "/search?q=kettle", "/category/garden", "/product/1", "/cart", "/orders", "/orders/000170"]:
        r = s.get(site + path)
        assert r.status_code == 200, path
        page = Page(r.text)
        links = dict(page.links)
        assert links["Harbor Goods"] == "/" and links["Cart (0)"] == "/cart" and links["My orders"] == "/orders"
        assert all(links[c["name"]] == f"/category/{c['slug']}" for c in DATA["categories"]), path
        search = next(f for f in page.forms if f["action"] == "/search")
        assert search["inputs"]["Search products"] == ("search", "q") and search["buttons"] == ["Search"]
    home = s.get(site + "/").text
    assert all(p["name"] in home for p in (BY_ID[i] for i in DATA["featured"]))
    assert f"Kitchen ({len(in_category('Kitchen'))} products)" in home


def test_product_pages_show_price_rating_sku_and_reviews(site):
    for product in DATA["products"]:
        text = unescape(requests.get(f"{site}/product/{product['id']}").text)
        assert f"<h1>{product['name']}</h1>" in text
        assert f"<p>Price: {money(price(product))}</p>" in text
        assert f"<p>SKU: {product['sku']}</p>" in text and product["description"] in text
        count = len(product["reviews"])
        if count:
            plural = "s" if count > 1 else ""
            assert f"<p>Rating: {rating(product)} out of 5 ({count} review{plural})</p>" in text
        else:
            assert "<p>Rating: No reviews yet</p>" in text
        for review in product["reviews"]:
            assert f"<p>Review by {review['author']}, {review['rating']} out of 5 stars</p>" in text
            assert review["title"] in text and review["text"] in text
        form = next(f for f in Page(text).forms if f["action"] == "/cart/add")
        assert form["method"] == "post" and form["fields"]["product_id"] == str(product["id"])
        assert form["inputs"]["Quantity"] == ("number", "qty") and form["buttons"] == ["Add to cart"]


def test_search_matches_name_and_description_words(site):
    def found(q):
        r = requests.get(site + "/search", params={"q": q})
        assert r.status_code == 200
        return unescape(r.text), sorted(name for name, _, _ in product_rows(r.text)) if "<table" in r.text else []

    text, names = found("lamp")
    assert names == ["Brass Reading Lamp", "Solar Path Lamp"]
    assert "<h1>Search results for 'lamp'</h1>" in text and "2 products found" in text
    assert found("LAMPS")[1] == names  # case and plural do not matter
    assert found("kettle")[1] == ["Copper Kettle"]
    assert found("infuser")[1] == ["Ceramic Teapot"]  # a description word
    assert found("garden light")[1] == ["Solar Path Lamp"]  # every word must match
    text, names = found("snowboard")
    assert names == [] and "No products match 'snowboard'." in text
    assert "<script>" not in requests.get(site + "/search", params={"q": "<script>"}).text  # the query is escaped


def test_category_sorts(site):
    garden = in_category("Garden")

    def rows(query=""):
        r = requests.get(f"{site}/category/garden{query}")
        assert r.status_code == 200
        return product_rows(r.text)

    assert [n for n, _, _ in rows()] == [p["name"] for p in garden]
    by_price = [money(price(p)) for p in sorted(garden, key=price)]
    assert [p for _, p, _ in rows("?sort=price")] == by_price
    assert [p for _, p, _ in rows("?sort=price&order=desc")] == by_price[::-1]
    assert [n for n, _, _ in rows("?sort=name")] == sorted(p["name"] for p in garden)
    ranked = rows("?sort=rating")
    marks = [Decimal(r.split()[0]) for _, _, r in ranked if r != "No reviews yet"]
    assert marks == sorted(marks, reverse=True) and ranked[-1][2] == "No reviews yet"
    assert requests.get(f"{site}/category/garden?sort=colour").status_code == 400
    assert requests.get(f"{site}/category/garden?sort=price&order=up").status_code == 400
    assert requests.get(f"{site}/category/furniture").status_code == 404


# -- cart, orders, sessions ---------------------------------------------------------------------

def test_cart_remove_and_checkout(site):
    s = requests.Session()
    r = s.post(site + "/cart/add", data={"product_id": 1, "qty": 2}, allow_redirects=False)
    assert r.status_code == 303 and r.headers["Location"] == "/cart" and "sid" in s.cookies
    s.post(site + "/cart/add", data={"product_id": 4, "qty": 1})
    cart = s.get(site + "/cart").text
    kettle, teapot = BY_ID[1], BY_ID[4]
    assert "Cart (3)" in cart
    assert element_text(cart, "cart") == (
        f"Product Price Quantity Line total Remove {kettle['name']} {money(price(kettle))} 2 "
        f"{money(price(kettle) * 2)} Remove {kettle['name']} {teapot['name']} {money(price(teapot))} 1 "
        f"{money(price(teapot))} Remove {teapot['name']}")
    assert element_text(cart, "subtotal") == f"Subtotal: {money(price(kettle) * 2 + price(teapot))}"

    s.post(site + "/cart/remove", data={"product_id": 1})
    cart = s.get(site + "/cart").text
    assert kettle["name"] not in element_text(cart, "cart")
    assert element_text(cart, "subtotal") == f"Subtotal: {money(price(teapot))}"

    r = s.post(site + "/checkout", allow_redirects=False)
    assert r.status_code == 303 and r.headers["Location"] == f"/orders/{NEXT_ORDER}"
    order = s.get(site + r.headers["Location"]).text
    assert teapot["name"] in element_text(order, "order-items")
    assert element_text(order, "order-total") == f"Total: {money(price(teapot))}"
    assert element_text(order, "order-status") == "Status: Pending"
    history = s.get(site + "/orders").text
    numbers = re.findall(r"View order (\d{6})", history)
    assert numbers == sorted([*ORDERS, NEXT_ORDER], reverse=True)  # newest first
    assert "Your cart is empty." in s.get(site + "/cart").text
    assert s.post(site + "/checkout").status_code == 400  # nothing to order


def test_seeded_orders(site):
    text = requests.get(site + "/orders").text
    for number, order in ORDERS.items():
        total = money(order_total(order))
        row = f"<tr><td>{number}</td><td>{order['date']}</td><td>{order['status']}</td><td>{total}</td>"
        assert row in text
        page = requests.get(f"{site}/orders/{number}").text
        assert element_text(page, "order-total") == f"Total: {money(order_total(order))}"
        assert element_text(page, "order-status") == f"Status: {order['status']}"
        assert all(BY_ID[i["product_id"]]["name"] in element_text(page, "order-items") for i in order["items"])
    assert requests.get(site + "/orders/000999").status_code == 404


def test_sessions_have_separate_carts_and_orders(site):
    a, b = requests.Session(), requests.Session()
    a.post(site + "/cart/add", data={"product_id": 7, "qty": 1})
    a.post(site + "/checkout")
    b.get(site + "/")
    assert a.cookies["sid"] != b.cookies["sid"]
    assert "Your cart is empty." in b.get(site + "/cart").text
    assert f"View order {NEXT_ORDER}" not in b.get(site + "/orders").text
    b.post(site + "/cart/add", data={"product_id": 8, "qty": 1})
    assert "Your cart is empty." in a.get(site + "/cart").text


def test_bad_input_and_caps(site):
    s = requests.Session()

    def add(product_id, qty):
        return s.post(site + "/cart/add", data={"product_id": product_id, "qty": qty})

    for qty in ("100", "0", "-1", "two", "", "1.5"):
        r = add(1, qty)
        assert r.status_code == 400 and "Quantity must be a whole number from 1 to 99" in unescape(r.text), qty
    assert add(999, 1).status_code == 400 and "Unknown product id" in add(999, 1).text
    assert add(1, 99).status_code == 200 and add(1, 1).status_code == 400  # a line holds at most 99
    assert s.post(site + "/cart/remove", data={"product_id": 2}).status_code == 400  # not in the cart
    big = s.post(site + "/cart/add", data={"product_id": 1, "qty": "1", "pad": "x" * 5000})
    assert big.status_code == 413
    r = requests.get(site + "/no/such/page")
    assert r.status_code == 404 and "Page not found" in r.text
    assert requests.get(site + "/product/999").status_code == 404
    assert requests.get(site + "/cart/add").status_code == 405
    assert requests.post(site + "/orders", data={}).status_code == 405


def test_limits_drop_old_sessions_and_cap_carts_and_orders():
    server, url = start_site(limits=Limits(sessions=2, cart_lines=2, orders=len(ORDERS) + 1))
    try:
        first = requests.Session()
        first.post(url + "/cart/add", data={"product_id": 1, "qty": 1})
        for _ in range(2):
            requests.get(url + "/")  # two newer sessions push the first one out
        assert "Your cart is empty." in first.get(url + "/cart").text

        s = requests.Session()
        assert s.post(url + "/cart/add", data={"product_id": 1, "qty": 1}).status_code == 200
        assert s.post(url + "/cart/add", data={"product_id": 2, "qty": 1}).status_code == 200
        assert s.post(url + "/cart/add", data={"product_id": 3, "qty": 1}).status_code == 400
        assert s.post(url + "/cart/add", data={"product_id": 2, "qty": 1}).status_code == 200  # a line grows
        assert s.post(url + "/checkout").status_code == 200
        s.post(url + "/cart/add", data={"product_id": 1, "qty": 1})
        assert s.post(url + "/checkout").status_code == 400  # past the orders cap
    finally:
        server.shutdown()


def test_slow_page_delays_only_itself():
    server, site = start_site()
    serving_slow, slow_seconds = threading.Event(), server.pages.slow_seconds
    server.pages.slow_seconds = lambda query: serving_slow.set() or slow_seconds(query)
    took = {}

    def slow():
        start = time.monotonic()
        took["status"] = requests.get(site + "/slow", params={"seconds": 5}).status_code
        took["s"] = time.monotonic() - start

    waiter = threading.Thread(target=slow)
    waiter.start()
    try:
        assert serving_slow.wait(60)
        assert requests.get(site + "/").status_code == 200
        assert "s" not in took  # answered while the slow page was still being served
        waiter.join(30)
        assert took["status"] == 200 and took["s"] >= 5.0
        assert requests.get(site + "/slow", params={"seconds": "soon"}).status_code == 400
    finally:
        server.shutdown()


def test_main_help():
    r = subprocess.run([sys.executable, "-m", "envs.webarena.site", "--help"], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert r.returncode == 0 and "--port" in r.stdout and "--host" in r.stdout


# -- tasks --------------------------------------------------------------------------------------

def _substitute(value: str, site: str) -> str:
    return value.replace("__SHOPPING__", site)


def test_tasks_are_well_formed_and_cover_every_evaluator():
    assert len(TASKS) >= 34
    counts = {k: 0 for k in ("exact_match", "must_include", "fuzzy_match", "N/A", "url_match", "program_html",
                             "combined")}
    per_split = {"train": set(), "test": set()}
    for i, task in enumerate(TASKS):
        assert task["task_id"] == i
        for key in ("sites", "require_login", "start_url", "intent_template", "instantiation_dict", "intent",
                    "split", "eval", "scripted"):
            assert key in task, (i, key)
        assert task["sites"] == ["shopping"] and task["start_url"].startswith("__SHOPPING__/")
        assert re.sub(r"\{\{(\w+)\}\}", lambda m: str(task["instantiation_dict"][m.group(1)]),
                      task["intent_template"]) == task["intent"]
        ev = task["eval"]
        for key in ("eval_types", "reference_answers", "reference_url", "program_html", "string_note", "url_note"):
            assert key in ev, (i, key)
        kinds = ev["eval_types"]
        per_split[task["split"]].update(kinds)
        counts["combined"] += len(kinds) > 1
        counts["url_match"] += "url_match" in kinds
        counts["program_html"] += "program_html" in kinds
        assert ("url_match" in kinds) == bool(ev["reference_url"])
        assert ("program_html" in kinds) == bool(ev["program_html"])
        if "string_match" in kinds:
            for key, value in ev["reference_answers"].items():
                counts["N/A" if value == "N/A" else key] += 1
            if ev["reference_answers"].get("fuzzy_match") == "N/A":
                assert ev["string_note"] and task["scripted"][-1] == ["stop", "N/A"]
        else:
            assert ev["reference_answers"] is None
        assert task["scripted"][-1][0] in ("stop", "stop_with"), i
    wanted = {"exact_match": 6, "must_include": 6, "fuzzy_match": 4, "N/A": 2, "url_match": 6, "program_html": 6,
              "combined": 2}
    assert all(counts[k] >= n for k, n in wanted.items()), counts
    assert per_split["train"] == per_split["test"] == {"string_match", "url_match", "program_html"}
    test_share = sum(t["split"] == "test" for t in TASKS) / len(TASKS)
    assert 0.2 <= test_share <= 0.3


def test_the_loader_accepts_the_tasks(site):
    from envs.webarena import tasks

    loaded = tasks.load(os.path.join(SITE, "tasks.json"), {"shopping": site})
    assert len(loaded) == len(TASKS) and all(t.start_urls[0].startswith(site) for t in loaded)


def test_task_pages_exist(site):
    for task in TASKS:
        ev = task["eval"]
        urls = [task["start_url"], *ev["reference_url"].split(" |OR| "), *(t["url"] for t in ev["program_html"])]
        for url in urls:
            if url.startswith("__SHOPPING__"):
                assert requests.get(_substitute(url, site)).status_code == 200, (task["task_id"], url)


def _search_hits(query: str) -> list[str]:
    return [p["name"] for p in DATA["products"]
            if re.search(rf"\b{re.escape(query)}", f"{p['name']} {p['description']}", re.I)]


def _review(product: str, **match) -> str:
    (author,) = [r["author"] for r in PRODUCTS[product]["reviews"] if all(r[k] == v for k, v in match.items())]
    return author


def _top(category: str, key) -> str:
    ranked = sorted(in_category(category), key=key, reverse=True)
    assert key(ranked[0]) != key(ranked[1]), f"a tie for first in {category}"
    return ranked[0]["name"]


# What each string_match template's reference answers must be, recomputed from the catalogue.
EXPECTED = {
    "What is the price of the {{product}}? Answer like $1.23.":
        lambda d: {"exact_match": money(price(PRODUCTS[d["product"]]))},
    "What is the average rating of the {{product}}? Answer with the number only.":
        lambda d: {"exact_match": str(rating(PRODUCTS[d["product"]]))},
    "How many reviews does the {{product}} have? Answer with a number.":
        lambda d: {"exact_match": str(len(PRODUCTS[d["product"]]["reviews"]))},
    "What is the cheapest product in the {{category}} category? Answer with its name.":
        lambda d: {"exact_match": _top(d["category"], lambda p: -price(p))},
    "What is the status of order {{number}}? Answer with the status only.":
        lambda d: {"exact_match": ORDERS[d["number"]]["status"]},
    "What was the total of order {{number}}? Answer like $1.23.":
        lambda d: {"exact_match": money(order_total(ORDERS[d["number"]]))},
    "What is the SKU of the {{product}}?": lambda d: {"exact_match": PRODUCTS[d["product"]]["sku"]},
    "What is the most expensive product in the {{category}} category? Answer with its name.":
        lambda d: {"exact_match": _top(d["category"], price)},
    "Which product in the {{category}} category has the highest average rating? Answer with its name.":
        lambda d: {"exact_match": _top(d["category"], lambda p: rating(p) or 0)},
    'Which products does a search for "{{query}}" find? List their names.':
        lambda d: {"must_include": _search_hits(d["query"])},
    'Who wrote the review titled "{{title}}" of the {{product}}?':
        lambda d: {"must_include": [_review(d["product"], title=d["title"])]},
    "Which products were in order {{number}}?":
        lambda d: {"must_include": [BY_ID[i["product_id"]]["name"] for i in ORDERS[d["number"]]["items"]]},
    "How many products are in the {{category}} category? Answer with a number.":
        lambda d: {"must_include": [str(len(in_category(d["category"])))]},
    "Which reviewer gave the {{product}} {{stars}} stars?":
        lambda d: {"must_include": [_review(d["product"], rating=d["stars"])]},
    "How many {{product}} were in order {{number}}? Answer with a number.":
        lambda d: {"must_include": [str(i["qty"]) for i in ORDERS[d["number"]]["items"]
                                    if BY_ID[i["product_id"]]["name"] == d["product"]]},
    "Open the product page of the {{product}} and tell me its price. Answer like $1.23.":
        lambda d: {"exact_match": money(price(PRODUCTS[d["product"]]))},
    "Order one {{product}} and tell me the number of the new order. Answer with the number only.":
        lambda d: {"exact_match": NEXT_ORDER},
    'Search the shop for "{{query}}" and tell me how many products match. Answer with a number.':
        lambda d: {"must_include": [str(len(_search_hits(d["query"])))]},
    "Add {{qty}} {{product}} to my cart and tell me the cart's subtotal. Answer like $1.23.":
        lambda d: {"exact_match": money(price(PRODUCTS[d["product"]]) * d["qty"])},
}


def test_string_references_match_the_catalogue():
    checked = 0
    for task in TASKS:
        references = task["eval"]["reference_answers"] or {}
        if "exact_match" in references or "must_include" in references:
            template = task["intent_template"]
            assert template in EXPECTED, f"task {task['task_id']}: no expectation for {template!r}"
            assert references == EXPECTED[template](task["instantiation_dict"]), task["task_id"]
            checked += 1
    assert checked >= 12


def _replay(site: str, task: dict) -> tuple[requests.Session, requests.Response]:
    """Runs the plan's navigation over HTTP: a link by its text, a form by its button's text or by
    Enter in an input named by its aria-label; the first match on the page, as the agent clicks."""
    roles = {"searchbox": "search", "spinbutton": "number"}
    s = requests.Session()
    r = s.get(_substitute(task["start_url"], site))
    typed: dict[tuple[int, str], str] = {}
    for step in task["scripted"]:
        page, where = Page(r.text), f"task {task['task_id']} step {step} on {r.url}"
        submit = None
        if step[0] == "goto":
            r = s.get(_substitute(step[1], site))
        elif step[0] == "click" and step[1] == "link":
            href = next((h for text, h in page.links if text == step[2]), None)
            assert href is not None, where
            r = s.get(urllib.parse.urljoin(r.url, href))
        elif step[0] == "click" and step[1] == "button":
            submit = next((i for i, f in enumerate(page.forms) if step[2] in f["buttons"]), None)
            assert submit is not None, where
        elif step[0] == "type":
            form = next((i for i, f in enumerate(page.forms) if step[2] in f["inputs"]), None)
            assert form is not None, where
            kind, name = page.forms[form]["inputs"][step[2]]
            assert roles[step[1]] == kind, where
            typed[form, name] = step[3]
            submit = form if step[4] else None
        else:
            assert step[0] in ("stop", "stop_with") and step is task["scripted"][-1], where
        if submit is not None:
            form = page.forms[submit]
            fields = {**form["fields"], **{n: v for (i, n), v in typed.items() if i == submit}}
            target = urllib.parse.urljoin(r.url, form["action"])
            r = s.post(target, data=fields) if form["method"] == "post" else s.get(target, params=fields)
        if step[0] != "type" or submit is not None:
            typed = {}  # a new page: what was typed on the old one is gone
        assert r.status_code == 200, where
    return s, r


def _url_matches(url: str, reference: str) -> bool:
    page, wanted = urllib.parse.urlsplit(url), urllib.parse.urlsplit(reference)
    query = urllib.parse.parse_qs(page.query)
    return (page.netloc, page.path.rstrip("/")) == (wanted.netloc, wanted.path.rstrip("/")) and all(
        query.get(k) == v for k, v in urllib.parse.parse_qs(wanted.query).items())


def _located(html: str, locator: str) -> str:
    if not locator:
        return html
    element = re.fullmatch(r"document\.querySelector\('#([\w-]+)'\)\.outerText", locator)
    assert element, f"locator {locator!r} is not one this test reads"
    return element_text(html, element.group(1)) or ""


def test_plans_reach_their_answers_and_the_url_and_html_references(site):
    for task in TASKS:
        s, last = _replay(site, task)
        ev = task["eval"]
        if task["scripted"][-1][0] == "stop_with":
            # The plan reads its answer off the page it ends on, so every reference must be shown there.
            shown = " ".join(unescape(re.sub(r"<[^>]+>", " ", last.text)).split()).lower()
            references = ev["reference_answers"]
            wanted = [references.get("exact_match", ""), *references.get("must_include", []),
                      *references.get("fuzzy_match", [])]
            assert all(w.lower() in shown for w in wanted), (task["task_id"], wanted, last.url)
        if "url_match" in ev["eval_types"]:
            references = [_substitute(u.strip(), site) for u in ev["reference_url"].split(" |OR| ")]
            assert any(_url_matches(last.url, ref) for ref in references), (task["task_id"], last.url)
        for target in ev["program_html"]:
            html = last.text if target["url"] == "last" else s.get(_substitute(target["url"], site)).text
            text = _located(html, target["locator"])
            required = target["required_contents"]
            if "exact_match" in required:
                assert text.strip().lower() == required["exact_match"].strip().lower(), (task["task_id"], text)
            else:
                for item in required["must_include"]:
                    assert any(alt.lower() in text.lower() for alt in item.split(" |OR| ")), (task["task_id"], item)
