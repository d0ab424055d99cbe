"""Deep Search (search-augmented QA, AgentGym's `searchqa`): questions answered by searching a
passage corpus through a retriever; see `env` for the episode and `options` for the settings.

`configure(options)` loads the questions and opens the retriever once per server; every instance
shares both and holds only its question and last observation (mostly the passages of its last
search): well under the 16 KiB the cap counts, by the RSS growth of 4,000 instances after a reset
and a search each (docs/results.md). A batch's steps run on 64 threads, whose searches the
retriever joins into one call per wave (`retriever.CoalescingRetriever`). Light on import: the
trainer reads `options` through this package without loading either.

AgentGym's searchqa client speaks a dialect of its own, served beside ours: `/create {"id"}`
answers a bare integer (the episode of task `id` started), later requests carry `env_idx`
(`/reset {"env_idx", "id": task}`), and the whole model reply is the action.
"""

from __future__ import annotations

from envs.environment import InvalidCreate, Kind, Task

# The CLI and the trainer import this package for `options`: the episode, the question loader and
# the retriever are imported by `configure`, on the env server.


def configure(opts):
    """The Kind for validated `options.DeepSearchOptions`: the questions loaded, the retriever opened."""
    from envs.deepsearch import retriever, tasks
    from envs.deepsearch.env import DeepSearchEnv

    questions = tasks.load(opts.data_dir)
    search = retriever.CoalescingRetriever(retriever.open_retriever(opts))
    catalogue = [Task(i, q.source, q.split) for i, q in enumerate(questions)]

    def check_create(body: dict) -> None:
        unknown = sorted(set(body) - {"id"})
        if unknown:
            raise InvalidCreate(f"/create fields {unknown} are not allowed; allowed: id (AgentGym's searchqa "
                                "client: the task to start), or no body")

    return Kind(name="deepsearch", make=lambda: DeepSearchEnv(questions, search, opts.topk, opts.max_query_chars),
                tasks=lambda: catalogue, size=lambda: len(questions), instance_bytes=16 << 10,
                index_range=f"an integer from 0 to {len(questions) - 1}", batch_threads=64,
                check_create=check_create, parse_action=lambda reply: reply, env_idx_task="id")
