"""`python -m envs.webarena.site`: serves the Harbor Goods shop in the foreground until Ctrl-C."""

import argparse

from envs.webarena.site.server import Catalog, Limits, ShopServer


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m envs.webarena.site",
        description="Serve Harbor Goods, the shop WebArena's shopping tasks (envs/webarena/site/tasks.json) run "
                    "against, logging each request. Each browser gets its own cart and a copy of the seeded "
                    "order history (cookie sid).")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only; the shop has no login)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on; 0 picks a free one (default 8080)")
    args = parser.parse_args()
    server = ShopServer((args.host, args.port), Catalog(), Limits(), log_requests=True)
    print(f"Harbor Goods at http://{args.host}:{server.server_address[1]} (Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
