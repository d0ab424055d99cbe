"""Harbor Goods: the small online shop WebArena's `shopping` tasks run against when no real site is given.

`server` serves it (plain HTML from the standard library's HTTP server, state per `sid` cookie),
`catalog.json` holds its products and the order history every new session starts with, and
`tasks.json` its tasks in WebArena's config form. `python -m envs.webarena.site` serves it in the
foreground.
"""
