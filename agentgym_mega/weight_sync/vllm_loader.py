"""Runs inside each vLLM worker process (mixed in through vLLM's `worker_extension_cls`)."""

from __future__ import annotations

import glob
import os
import time

from safetensors import safe_open

from agentgym_mega.weight_sync.zmq_transport import StagingArea, SyncError, ZmqWeightReceiver


def checkpoint_shapes(model_dir: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Hugging Face safetensors checkpoint (headers only)."""
    shapes = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if not shapes:
        raise SyncError(f"no *.safetensors files in {model_dir} to check weight updates against")
    return shapes


def check_complete(expected: dict[str, tuple[int, ...]], tensors) -> None:
    """An update must carry exactly the checkpoint's tensors with their shapes; checked before
    anything is loaded, so a wrong update leaves the served weights untouched."""
    got = {name: tuple(t.shape) for name, t in tensors}
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    wrong = sorted(n for n in set(got) & set(expected) if got[n] != expected[n])
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing (e.g. {missing[0]})")
    if extra:
        problems.append(f"{len(extra)} unknown (e.g. {extra[0]})")
    if wrong:
        problems.append(f"{wrong[0]} has shape {got[wrong[0]]}, expected {expected[wrong[0]]}")
    if problems:
        raise SyncError("weight update rejected: " + "; ".join(problems))


def _refresh_tied_lm_head(model) -> None:
    """Checkpoints of tied models carry no lm_head.weight, so vLLM's layerwise reload updates
    embed_tokens but restores the LM head's derived kernel (on CPU a packed GEMM weight) from
    before the update. Re-tie it and rebuild that kernel from the new embedding."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        return
    model.lm_head.weight = model.model.embed_tokens.weight
    model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


class VLLMWeightLoader:
    """Worker methods callable through `LLM.collective_rpc` (prefixed to avoid clashes)."""

    def agm_receive_weights(self, address: str, version: int, timeout_s: float,
                            secret: str | bytes | None = None) -> int:
        if not hasattr(self, "_agm_shapes"):
            self._agm_shapes = checkpoint_shapes(self.vllm_config.model_config.model)
            self._agm_staging = StagingArea()
        # Refuses tcp:// without a secret, and CUDA IPC handles anywhere but over ipc://.
        receiver = ZmqWeightReceiver(address, timeout_s, self._agm_staging, secret=secret)
        try:
            got, tensors = receiver.receive(version)
            if got != version:
                raise SyncError(f"expected weights version {version}, the trainer sent {got}")
            check_complete(self._agm_shapes, tensors)
            start = time.perf_counter()
            # vLLM's own in-place reload: its loaders fuse QKV / gate-up, shard for TP and redo
            # any post-load processing (e.g. CPU weight packing).
            self.reload_weights(weights_iterator=iter(tensors))
            _refresh_tied_lm_head(self.model_runner.get_model())
        except Exception as exc:
            receiver.reply(version, error=f"{type(exc).__name__}: {exc}")
            receiver.close()
            raise
        receiver.reply(version, load_seconds=time.perf_counter() - start)
        receiver.close()
        return version
