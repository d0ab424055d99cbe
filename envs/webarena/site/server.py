"""Harbor Goods, a small shop for WebArena-style tasks, served by the standard library's HTTP server.

Pages are plain HTML without JavaScript, written for an agent that reads Chromium's accessibility
tree: every control has an accessible name, each fact a task asks about is one text run
("Price: $34.50", "Rating: 4.7 out of 5 (3 reviews)", "Status: Shipped"), and pages stay short
enough to fit a 1280x720 viewport. Every page's header holds the shop's name (a link home), the
search box ("Search products"), the category links, "Cart (N)" and "My orders".

- `/` categories and featured products; `/search?q=` products whose name or description has a
  word starting with each query word (case-insensitive; a plural query word also matches its
  singular); `/category/<slug>?sort=price|name|rating&order=asc|desc`.
- `/product/<id>` the product, an add-to-cart form (POST `/cart/add`: product_id, qty) and reviews.
- `/cart` (`#cart`, `#subtotal`, "Remove <name>" buttons posting `/cart/remove`, "Place order"
  posting `/checkout`), `/orders` (newest first), `/orders/<number>` (`#order-items`,
  `#order-total`, `#order-status`, `#order-date`). Forms answer 303 to the page that shows the result.
- `/slow?seconds=N` answers after N seconds (at most `Limits.slow_s`), to exercise page timeouts.

State lives per `sid` cookie: a new session has an empty cart and the catalogue's seeded order
history (orders 000170-000175); its new orders continue the numbering. `Limits` caps what one
client can make the server hold. Errors are HTML pages: 400 bad input (saying what is wrong),
404 unknown page, 405 wrong method, 413 a body over the limit.
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import http.cookies
import json
import math
import os
import re
import secrets
import sys
import threading
import time
import urllib.parse
from collections import OrderedDict
from decimal import ROUND_HALF_UP, Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

CATALOG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "catalog.json")
# Each sort key's order when the URL gives none: cheapest, A to Z, best rated first.
SORTS = {"price": "asc", "name": "asc", "rating": "desc"}
_SORT_NOTES = {("price", "asc"): "Sorted by price, lowest first", ("price", "desc"): "Sorted by price, highest first",
               ("name", "asc"): "Sorted by name, A to Z", ("name", "desc"): "Sorted by name, Z to A",
               ("rating", "desc"): "Sorted by rating, highest first",
               ("rating", "asc"): "Sorted by rating, lowest first"}
_WORD = re.compile(r"[a-z0-9]+")
# A body larger than this is not read to the end before the 413; the connection is just closed.
_DRAIN_BYTES = 1 << 20

_STYLE = """body{font:15px/1.35 system-ui,sans-serif;margin:0 16px;color:#222}
header{display:flex;flex-wrap:wrap;gap:4px 18px;align-items:center;padding:6px 0;border-bottom:1px solid #ccc}
.brand{font-weight:bold;font-size:18px}nav a{margin-right:10px}form{display:inline}
h1{font-size:22px;margin:10px 0 6px}h2{font-size:17px;margin:12px 0 4px}h3{font-size:15px;margin:8px 0 2px}
p,ul{margin:4px 0}table{border-collapse:collapse;margin:6px 0}th,td{border:1px solid #ccc;padding:2px 8px;
text-align:left}footer{margin-top:16px;padding:6px 0;border-top:1px solid #ccc;font-size:13px;color:#555}"""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one client can make the server hold or do."""
    sessions: int = 4096  # sessions kept; the least recently used is dropped past this
    cart_lines: int = 50
    max_qty: int = 99  # of one product in a cart line (and in one add)
    body_bytes: int = 4096
    orders: int = 200  # per session, the seeded ones included
    slow_s: float = 60.0


@dataclasses.dataclass(frozen=True)
class Review:
    author: str
    rating: int
    title: str
    text: str


@dataclasses.dataclass(frozen=True)
class Product:
    id: int
    name: str
    category: str
    price: Decimal
    sku: str
    description: str
    reviews: tuple[Review, ...]

    @property
    def rating(self) -> Decimal | None:
        """The reviews' mean rating to one decimal (halves up); None without reviews."""
        if not self.reviews:
            return None
        mean = Decimal(sum(r.rating for r in self.reviews)) / len(self.reviews)
        return mean.quantize(Decimal("0.1"), ROUND_HALF_UP)


@dataclasses.dataclass(frozen=True)
class Line:
    product: Product
    price: Decimal  # the price when ordered
    qty: int

    @property
    def total(self) -> Decimal:
        return self.price * self.qty


@dataclasses.dataclass(frozen=True)
class Order:
    number: str
    date: str
    status: str
    lines: tuple[Line, ...]

    @property
    def total(self) -> Decimal:
        return sum((line.total for line in self.lines), Decimal(0))


class Catalog:
    """The products, categories and seeded orders of `catalog.json` (prices as exact Decimals)."""

    def __init__(self, path: str = CATALOG):
        with open(path, encoding="utf-8") as f:
            data = json.load(f, parse_float=Decimal)
        self.shop: str = data["shop"]
        self.categories: dict[str, str] = {c["slug"]: c["name"] for c in data["categories"]}
        self.products: dict[int, Product] = {
            p["id"]: Product(p["id"], p["name"], p["category"], Decimal(p["price"]), p["sku"], p["description"],
                             tuple(Review(**r) for r in p["reviews"]))
            for p in data["products"]}
        self.featured = [self.products[i] for i in data["featured"]]
        self.orders = tuple(
            Order(o["number"], o["date"], o["status"],
                  tuple(Line(self.products[i["product_id"]], self.products[i["product_id"]].price, i["qty"])
                        for i in o["items"]))
            for o in data["orders"])
        self._words = {p.id: set(_WORD.findall(f"{p.name} {p.description}".lower())) for p in self.products.values()}

    def in_category(self, slug: str) -> list[Product]:
        return [p for p in self.products.values() if p.category == slug]

    def search(self, query: str) -> list[Product]:
        """Products having, for every query word, a name or description word that starts with it."""
        wanted = [_singular(w) for w in _WORD.findall(query.lower())]
        if not wanted:
            return []
        return [p for p in self.products.values()
                if all(any(word.startswith(w) for word in self._words[p.id]) for w in wanted)]


def _singular(word: str) -> str:
    # "lamps" finds "lamp"; "glass" stays whole.
    return word[:-1] if len(word) > 3 and word.endswith("s") and not word.endswith("ss") else word


def sort_products(products: list[Product], key: str, order: str) -> list[Product]:
    """Products by `key` ("price", "name", "rating") in `order` ("asc", "desc"), ties by name;
    unrated products last in either order."""
    by_name = sorted(products, key=lambda p: p.name)
    if key == "name":
        return by_name[::-1] if order == "desc" else by_name
    value = (lambda p: p.price) if key == "price" else (lambda p: p.rating)
    # Sorting is stable, so ties keep the name order.
    valued = sorted((p for p in by_name if value(p) is not None), key=value, reverse=order == "desc")
    return valued + [p for p in by_name if value(p) is None]


@dataclasses.dataclass
class Session:
    orders: list[Order]
    cart: dict[int, int] = dataclasses.field(default_factory=dict)  # product id -> quantity, in order added


class Problem(Exception):
    """A request the shop refuses; shown as an HTML page with `status`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class Shop:
    """The catalogue and every session's cart and orders; the caller holds `lock` around any use."""

    def __init__(self, catalog: Catalog, limits: Limits):
        self.catalog = catalog
        self.limits = limits
        self.lock = threading.Lock()
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def session(self, sid: str | None) -> tuple[str, Session, bool]:
        """(sid, session, whether it is new): `sid`'s session, or a fresh one when it has none."""
        found = self._sessions.get(sid) if sid else None
        if found is not None:
            self._sessions.move_to_end(sid)
            return sid, found, False
        sid = secrets.token_urlsafe(16)
        self._sessions[sid] = found = Session(orders=list(self.catalog.orders))
        while len(self._sessions) > self.limits.sessions:
            self._sessions.popitem(last=False)
        return sid, found, True

    def product(self, raw: str | None) -> Product:
        product = self.catalog.products.get(_number(raw))
        if product is None:
            raise Problem(400, f"Unknown product id {raw!r}.")
        return product

    def add(self, session: Session, product: Product, raw_qty: str | None) -> None:
        top = self.limits.max_qty
        qty = _number(raw_qty)
        if qty is None or not 1 <= qty <= top:
            raise Problem(400, f"Quantity must be a whole number from 1 to {top}, not {raw_qty!r}.")
        have = session.cart.get(product.id, 0)
        if have + qty > top:
            raise Problem(400, f"The cart can hold at most {top} of {product.name}; it has {have}.")
        if not have and len(session.cart) >= self.limits.cart_lines:
            raise Problem(400, f"The cart holds at most {self.limits.cart_lines} different products.")
        session.cart[product.id] = have + qty

    def remove(self, session: Session, product: Product) -> None:
        if session.cart.pop(product.id, None) is None:
            raise Problem(400, f"{product.name} is not in your cart.")

    def checkout(self, session: Session) -> Order:
        if not session.cart:
            raise Problem(400, "Your cart is empty; add a product before placing an order.")
        if len(session.orders) >= self.limits.orders:
            raise Problem(400, f"A session holds at most {self.limits.orders} orders.")
        number = f"{max(int(o.number) for o in session.orders) + 1:06d}" if session.orders else "000001"
        products = self.catalog.products
        order = Order(number, datetime.date.today().isoformat(), "Pending",
                      tuple(Line(products[i], products[i].price, q) for i, q in session.cart.items()))
        session.orders.append(order)
        session.cart.clear()
        return order


def _number(raw: str | None) -> int | None:
    """A form's or URL's whole number (ASCII digits, at most 9); None for anything else."""
    found = re.fullmatch(r"\s*([0-9]{1,9})\s*", raw or "")
    return int(found.group(1)) if found else None


def money(amount: Decimal) -> str:
    return f"${amount:,.2f}"


def rating_text(product: Product) -> str:
    return "No reviews yet" if product.rating is None else f"{product.rating} out of 5"


@dataclasses.dataclass
class Page:
    title: str
    body: str
    status: int = 200
    query: str = ""  # shown in the search box


@dataclasses.dataclass
class Redirect:
    location: str


def _e(text) -> str:
    return html.escape(str(text), quote=True)


class Pages:
    """Builds each page from the shop's state; methods named after routes."""

    def __init__(self, shop: Shop):
        self.shop = shop
        self.catalog = shop.catalog

    def layout(self, page: Page, session: Session) -> str:
        categories = " ".join(f'<a href="/category/{slug}">{_e(name)}</a>'
                              for slug, name in self.catalog.categories.items())
        count = sum(session.cart.values())
        return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(page.title)}</title>'
                f'<style>{_STYLE}</style></head><body><header><a class="brand" href="/">{_e(self.catalog.shop)}</a>'
                f'<form action="/search" method="get" role="search"><input type="search" name="q" '
                f'aria-label="Search products" value="{_e(page.query)}"> <button>Search</button></form>'
                f'<nav aria-label="Categories">{categories}</nav>'
                f'<nav aria-label="Account"><a href="/cart">Cart ({count})</a> <a href="/orders">My orders</a></nav>'
                f'</header><main>{page.body}</main>'
                f'<footer><p>{_e(self.catalog.shop)}. Free returns within 30 days.</p></footer></body></html>')

    def product_table(self, products: list[Product]) -> str:
        rows = "".join(f'<tr><td><a href="/product/{p.id}">{_e(p.name)}</a></td><td>{money(p.price)}</td>'
                       f'<td>{rating_text(p)}</td></tr>' for p in products)
        return ('<table id="products"><thead><tr><th>Product</th><th>Price</th><th>Rating</th></tr></thead>'
                f'<tbody>{rows}</tbody></table>')

    def home(self, session: Session) -> Page:
        links = "".join(f'<li><a href="/category/{slug}">{_e(name)} ({len(self.catalog.in_category(slug))} '
                        f'products)</a></li>' for slug, name in self.catalog.categories.items())
        return Page(self.catalog.shop, f'<h1>Welcome to {_e(self.catalog.shop)}</h1><h2>Shop by category</h2>'
                                       f'<ul>{links}</ul><h2>Featured products</h2>'
                                       f'{self.product_table(self.catalog.featured)}')

    def search(self, query: dict[str, list[str]]) -> Page:
        q = query.get("q", [""])[0].strip()
        if not q:
            return Page("Search", "<h1>Search</h1><p>Type a word into the search box to find products.</p>")
        found = self.catalog.search(q)
        title = f"Search results for '{q}'"
        if not found:
            body = f"<p>No products match '{_e(q)}'.</p>"
        else:
            body = f"<p>{len(found)} product{'s' if len(found) != 1 else ''} found</p>{self.product_table(found)}"
        return Page(title, f"<h1>{_e(title)}</h1>{body}", query=q)

    def category(self, slug: str, query: dict[str, list[str]]) -> Page:
        name = self.catalog.categories.get(slug)
        if name is None:
            raise Problem(404, f"There is no category {slug!r}.")
        products = self.catalog.in_category(slug)
        sort = query.get("sort", [None])[0]
        note = ""
        if sort is not None:
            if sort not in SORTS:
                raise Problem(400, f"Unknown sort {sort!r}; use one of: {', '.join(SORTS)}.")
            order = query.get("order", [SORTS[sort]])[0]
            if order not in ("asc", "desc"):
                raise Problem(400, f"Unknown order {order!r}; use asc or desc.")
            products = sort_products(products, sort, order)
            note = f"<p>{_SORT_NOTES[sort, order]}</p>"
        base = f"/category/{slug}"
        sorts = (f'<nav aria-label="Sort products"><a href="{base}?sort=price">Sort by price</a> '
                 f'<a href="{base}?sort=price&amp;order=desc">Highest price first</a> '
                 f'<a href="{base}?sort=name">Sort by name</a> <a href="{base}?sort=rating">Sort by rating</a></nav>')
        return Page(name, f"<h1>{_e(name)}</h1><p>{len(products)} products</p>{sorts}{note}"
                          f"{self.product_table(products)}")

    def product(self, raw_id: str) -> Page:
        product = self.catalog.products.get(_number(raw_id))
        if product is None:
            raise Problem(404, f"There is no product {raw_id!r}.")
        count = len(product.reviews)
        rating = (f"Rating: {product.rating} out of 5 ({count} review{'s' if count != 1 else ''})"
                  if count else "Rating: No reviews yet")
        reviews = "".join(f"<article><h3>{_e(r.title)}</h3><p>Review by {_e(r.author)}, {r.rating} out of 5 stars</p>"
                          f"<p>{_e(r.text)}</p></article>" for r in product.reviews)
        body = (f"<h1>{_e(product.name)}</h1><p>Price: {money(product.price)}</p><p>{rating}</p>"
                f"<p>Category: {_e(self.catalog.categories[product.category])}</p><p>SKU: {_e(product.sku)}</p>"
                f"<p>{_e(product.description)}</p>"
                f'<form method="post" action="/cart/add"><input type="hidden" name="product_id" value="{product.id}">'
                f'<label for="qty">Quantity</label> <input type="number" id="qty" name="qty" aria-label="Quantity" '
                f'value="1"> <button>Add to cart</button></form>'
                f"<h2>Customer reviews</h2>{reviews or '<p>No reviews yet.</p>'}")
        return Page(product.name, body)

    def cart(self, session: Session) -> Page:
        if not session.cart:
            return Page("Shopping cart", "<h1>Shopping cart</h1><p>Your cart is empty.</p>")
        products = self.catalog.products
        lines = [Line(products[i], products[i].price, q) for i, q in session.cart.items()]
        rows = "".join(
            f'<tr><td><a href="/product/{line.product.id}">{_e(line.product.name)}</a></td>'
            f"<td>{money(line.price)}</td><td>{line.qty}</td><td>{money(line.total)}</td>"
            f'<td><form method="post" action="/cart/remove"><input type="hidden" name="product_id" '
            f'value="{line.product.id}"><button>Remove {_e(line.product.name)}</button></form></td></tr>'
            for line in lines)
        subtotal = sum((line.total for line in lines), Decimal(0))
        return Page("Shopping cart", '<h1>Shopping cart</h1><table id="cart"><thead><tr><th>Product</th>'
                                     "<th>Price</th><th>Quantity</th><th>Line total</th><th>Remove</th></tr></thead>"
                                     f'<tbody>{rows}</tbody></table><p id="subtotal">Subtotal: {money(subtotal)}</p>'
                                     '<form method="post" action="/checkout"><button>Place order</button></form>')

    def orders(self, session: Session) -> Page:
        rows = "".join(f"<tr><td>{o.number}</td><td>{o.date}</td><td>{o.status}</td><td>{money(o.total)}</td>"
                       f'<td><a href="/orders/{o.number}">View order {o.number}</a></td></tr>'
                       for o in sorted(session.orders, key=lambda o: o.number, reverse=True))
        return Page("My orders", '<h1>My orders</h1><table id="orders"><thead><tr><th>Order #</th><th>Date</th>'
                                 f"<th>Status</th><th>Total</th><th>Details</th></tr></thead><tbody>{rows}</tbody>"
                                 "</table>")

    def order(self, session: Session, number: str) -> Page:
        order = next((o for o in session.orders if o.number == number), None)
        if order is None:
            raise Problem(404, f"There is no order {number!r}.")
        rows = "".join(f'<tr><td><a href="/product/{line.product.id}">{_e(line.product.name)}</a></td>'
                       f"<td>{money(line.price)}</td><td>{line.qty}</td><td>{money(line.total)}</td></tr>"
                       for line in order.lines)
        return Page(f"Order {number}", f'<h1>Order {number}</h1><p id="order-date">Date: {order.date}</p>'
                                       f'<p id="order-status">Status: {order.status}</p><table id="order-items">'
                                       "<thead><tr><th>Product</th><th>Price</th><th>Quantity</th><th>Line total</th>"
                                       f"</tr></thead><tbody>{rows}</tbody></table>"
                                       f'<p id="order-total">Total: {money(order.total)}</p>')

    def slow_seconds(self, query: dict[str, list[str]]) -> float:
        raw = query.get("seconds", ["1"])[0]
        try:
            seconds = float(raw)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds < 0:
            raise Problem(400, f"seconds must be a number of seconds, not {raw!r}.")
        return min(seconds, self.shop.limits.slow_s)


class _Handler(BaseHTTPRequestHandler):
    server: ShopServer
    server_version = "HarborGoods/1.0"
    timeout = 60  # seconds a socket read or write may stall, so a client that stops sending frees its thread

    def do_GET(self):
        self._serve()

    def do_POST(self):
        self._serve()

    def _serve(self) -> None:
        shop, pages = self.server.shop, self.server.pages
        url = urllib.parse.urlsplit(self.path)
        path = url.path.rstrip("/") or "/"
        query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
        try:
            form = self._form() if self.command == "POST" else {}
            problem = None
        except Problem as exc:
            form, problem = {}, exc
        if path == "/slow" and problem is None and self.command == "GET":
            try:
                # Sleeps holding no lock: other pages keep answering meanwhile.
                time.sleep(pages.slow_seconds(query))
            except Problem as exc:
                problem = exc
        with shop.lock:
            sid, session, new = shop.session(self._sid())
            try:
                if problem is not None:
                    raise problem
                result = self._route(path, query, form, session)
            except Problem as exc:
                heading = "Page not found" if exc.status == 404 else "Sorry, that did not work"
                result = Page(heading, f"<h1>{heading}</h1><p>{_e(exc.message)}</p>", exc.status)
            text = pages.layout(result, session) if isinstance(result, Page) else ""
        if isinstance(result, Redirect):
            self._send(303, f'<a href="{_e(result.location)}">Continue</a>', sid if new else None, result.location)
        else:
            self._send(result.status, text, sid if new else None)

    def _route(self, path: str, query: dict, form: dict, session: Session) -> Page | Redirect:
        shop, pages = self.server.shop, self.server.pages
        gets = {"/": lambda: pages.home(session), "/search": lambda: pages.search(query),
                "/cart": lambda: pages.cart(session), "/orders": lambda: pages.orders(session),
                "/slow": lambda: Page("Slow page", "<h1>Slow page</h1><p>This page took its time.</p>")}
        if path in ("/cart/add", "/cart/remove", "/checkout"):
            if self.command != "POST":
                raise Problem(405, f"{path} takes a form submission (POST); use the buttons on the pages.")
            if path == "/checkout":
                return Redirect(f"/orders/{shop.checkout(session).number}")
            product = shop.product(form.get("product_id"))
            if path == "/cart/add":
                shop.add(session, product, form.get("qty"))
            else:
                shop.remove(session, product)
            return Redirect("/cart")
        found = gets.get(path)
        routed = re.fullmatch(r"/(category|product|orders)/([^/]+)", path)
        if found is None and routed is None:
            raise Problem(404, f"There is no page at {path}.")
        if self.command != "GET":
            raise Problem(405, f"{path} is a page to view (GET), not a form to submit.")
        if found is not None:
            return found()
        kind, name = routed.groups()
        if kind == "category":
            return pages.category(name, query)
        if kind == "product":
            return pages.product(name)
        return pages.order(session, name)

    def _form(self) -> dict[str, str]:
        """The urlencoded form body's fields (the first value of each); 413 past the body limit."""
        declared = self.headers.get("Content-Length", "0").strip()
        if not declared.isdigit():
            raise Problem(400, f"Content-Length {declared!r} is not a byte count.")
        size = int(declared)
        if size > self.server.shop.limits.body_bytes:
            if size <= _DRAIN_BYTES:
                # Read what the client sent, so closing the socket does not reset it before it reads the 413.
                self.rfile.read(size)
            else:
                self.close_connection = True
            raise Problem(413, f"The form is larger than {self.server.shop.limits.body_bytes} bytes.")
        raw = self.rfile.read(size).decode("utf-8", "replace")
        return {k: v[0] for k, v in urllib.parse.parse_qs(raw, keep_blank_values=True).items()}

    def _sid(self) -> str | None:
        jar = http.cookies.SimpleCookie()
        try:
            jar.load(self.headers.get("Cookie", ""))
        except http.cookies.CookieError:
            return None
        morsel = jar.get("sid")
        return morsel.value if morsel else None

    def _send(self, status: int, text: str, new_sid: str | None, location: str | None = None) -> None:
        data = text.encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        # The header's cart count must be fresh after Back, so no page is cached.
        self.send_header("Cache-Control", "no-store")
        if location:
            self.send_header("Location", location)
        if new_sid:
            self.send_header("Set-Cookie", f"sid={new_sid}; Path=/; HttpOnly; SameSite=Lax")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args):
        if self.server.log_requests:
            super().log_message(format, *args)


class ShopServer(ThreadingHTTPServer):
    """The shop's HTTP server: a thread per request (daemon threads); `shutdown` also closes the socket."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], catalog: Catalog, limits: Limits, log_requests: bool = False):
        super().__init__(address, _Handler)
        self.shop = Shop(catalog, limits)
        self.pages = Pages(self.shop)
        self.log_requests = log_requests

    def shutdown(self) -> None:
        super().shutdown()
        self.server_close()

    def handle_error(self, request, client_address) -> None:
        # A browser that navigates away mid-answer (a slow page, a timeout) breaks the pipe: not an error.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def start_site(host: str = "127.0.0.1", port: int = 0, *, limits: Limits = Limits(), catalog: str = CATALOG,
               log_requests: bool = False) -> tuple[ShopServer, str]:
    """Serves the shop from a daemon thread; returns (server, base URL without a trailing slash).
    Port 0 picks a free one. `server.shutdown()` stops it."""
    server = ShopServer((host, port), Catalog(catalog), limits, log_requests)
    threading.Thread(target=server.serve_forever, name="harbor-goods", daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}"
