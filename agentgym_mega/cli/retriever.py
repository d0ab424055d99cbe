"""`agentgym-mega retriever`: Deep Search's passage index, built or served over HTTP."""

from __future__ import annotations

import sys

from agentgym_mega.cli.options import COUNT, add_server_security, command, port
from agentgym_mega.errors import BadInput
from envs.deepsearch import retriever
from envs.deepsearch.retriever import RetrieverInputError, build_index

DEVICES = ("cpu", "cuda")

# The servers are imported when a command runs: their web stack (FastAPI, uvicorn) would slow
# every --help.


def add(sub) -> None:
    p = command(
        sub, "retriever",
        help="build a Deep Search retriever index (BM25, optionally dense) or serve one over HTTP",
        description=(
            "build: indexes a Search-R1/FlashRAG passage corpus into a directory.\n"
            "serve: answers POST /retrieve from such a directory in Search-R1's retrieval-server format.\n"
            "Environments take the directory (in-process) or the server's URL alike."
        ),
    )
    commands = p.add_subparsers(dest="action", required=True, metavar="<build|serve>")
    b = command(
        commands, "build", func=run_build,
        help="index a passage corpus with BM25 (and a dense encoder with --dense-model)",
        description=(
            "Reads --corpus (JSONL, one {\"id\", \"contents\"} per line, contents the title, a newline,\n"
            "then the text: Search-R1's and FlashRAG's corpora) and writes --out: bm25s's BM25 index\n"
            "(lower case, English stopwords, no stemmer), the passages (read memory-mapped) and\n"
            "retriever.json; with --dense-model also a FAISS flat inner-product index of the passages\n"
            "encoded by that local sentence-transformers directory (e5 style: `passage: ` prefix, the\n"
            "model's own pooling, normalised; queries get `query: `). Nothing is downloaded. The index\n"
            "is built beside --out and moved into place once complete: a line that is not JSON, lacks\n"
            "id or contents or repeats an id exits 2 naming the file and line, and writes nothing.\n"
            "Prints the passages, seconds, passages/s and the size on disk."
        ),
    )
    b.add_argument("--corpus", required=True, help="passage corpus, JSONL")
    b.add_argument("--out", required=True, help="index directory to write (replaced once the build completes)")
    b.add_argument("--dense-model", help="local sentence-transformers directory (e.g. a saved intfloat/e5-base-v2): "
                                         "also build the dense index")
    b.add_argument("--batch-size", type=COUNT, default=64, help="passages per encoder batch (default 64)")
    b.add_argument("--device", choices=DEVICES, help="where the encoder runs (default: cuda when torch sees "
                                                      "a GPU, else cpu)")
    s = command(
        commands, "serve", func=run_serve,
        help="serve an index over HTTP (Search-R1's POST /retrieve)",
        description=(
            "Loads --index memory-mapped and answers POST /retrieve {\"queries\": [...], \"topk\": 3,\n"
            "\"return_scores\": true} with {\"result\": [[{\"document\": {\"id\", \"contents\"}, \"score\": s},\n"
            "...], ...]} (without return_scores: the documents alone), best first, as Search-R1's\n"
            "retrieval server does; GET /health reports the passages, the mode and the limits. A\n"
            "request over --max-queries, --max-topk or --max-query-chars answers 400, a body over\n"
            "--max-body-bytes 413. With a secret (--secret-file, or $AGENTGYM_MEGA_SECRET) every\n"
            "request but GET /health needs `Authorization: Bearer <secret>` (else 401). A --host\n"
            "other than loopback needs a secret unless --insecure."
        ),
    )
    s.add_argument("--index", required=True, help="index directory from `agentgym-mega retriever build`")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=port, default=8000, help="port to bind (default 8000; 0: any free one)")
    s.add_argument("--mode", choices=retriever.MODES, help="default: dense when the index has it, else bm25")
    s.add_argument("--device", choices=DEVICES, help="where the dense query encoder runs (default: cuda "
                                                      "when torch sees a GPU, else cpu)")
    add_server_security(s)
    s.add_argument("--max-queries", type=COUNT, default=retriever.MAX_QUERIES,
                   help="most queries in one request; more answers 400 (default %(default)s)")
    s.add_argument("--max-topk", type=COUNT, default=retriever.MAX_TOPK,
                   help="largest topk; larger answers 400 (default %(default)s)")
    s.add_argument("--max-query-chars", type=COUNT, default=retriever.MAX_QUERY_CHARS,
                   help="longest query in characters; longer answers 400 (default %(default)s)")


def run_build(args) -> int:
    try:
        report = build_index(args.corpus, args.out, args.dense_model, args.batch_size, device=args.device)
    except RetrieverInputError as exc:
        raise BadInput(str(exc)) from None
    print(f"indexed {report['passages']} passages ({', '.join(report['indexes'])}) into {args.out} in "
          f"{report['seconds']:.1f} s: {report['passages_per_s']:.0f} passages/s, "
          f"{report['bytes'] / 2**20:.2f} MiB on disk")
    return 0


def run_serve(args) -> int:
    from envs.deepsearch.retriever_server import make_server
    from envs.server import read_secret_file

    try:
        secret = read_secret_file(args.secret_file) if args.secret_file else None
        server = make_server(args.index, args.host, args.port, args.mode, device=args.device, secret=secret,
                             insecure=args.insecure, max_body_bytes=args.max_body_bytes, max_queries=args.max_queries,
                             max_topk=args.max_topk, max_query_chars=args.max_query_chars)
    except ValueError as exc:  # a setting, index or mode that is not allowed (the message names it)
        raise BadInput(str(exc)) from None
    state = server.config.app.state
    sock = server.config.bind_socket()  # bound before the line below, so it names the port 0 got
    print(f"serving the {state.retriever.mode} retriever over {len(state.retriever)} passages on "
          f"http://{args.host}:{sock.getsockname()[1]} (authentication {'on' if state.secured else 'off'})",
          file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 0

