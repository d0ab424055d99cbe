"""Runs inside each vLLM worker process (mixed in through vLLM's `worker_extension_cls`)."""

from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open

from agentgym_mega.weight_sync.base import Receiver, SyncError
from agentgym_mega.weight_sync.factory import receiver_of
from agentgym_mega.weight_sync.handles import device_id

# vllm is imported where used: it is heavy, and tools and tests read checkpoint_shapes without it.


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


def _refresh_tied_lm_head(model) -> None:
    """Checkpoints of tied models carry no lm_head.weight, so vLLM's layerwise reload updates
    embed_tokens but restores the LM head's derived kernel (on CPU a packed GEMM weight) from
    before the update. Re-tie it and rebuild that kernel from the new embedding."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        return
    model.lm_head.weight = model.model.embed_tokens.weight
    model.lm_head.quant_method.process_weights_after_loading(model.lm_head)


# vLLM's CPU kernels pack a linear layer's weight into this closure and empty the parameter.
_CPU_KERNEL = "cpu_linear"


def _snapshot(model) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """What a streamed update that fails part-way is rolled back to: a host copy of this
    worker's weights as served (its TP shard, in kernel format) and, on CPU, the packed kernels
    themselves (a reload builds new ones, so holding the old ones keeps them intact)."""
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    kernels = {name: getattr(m, _CPU_KERNEL) for name, m in model.named_modules() if hasattr(m, _CPU_KERNEL)}
    return {name: t.detach().to("cpu", copy=True) for name, t in state.items()}, kernels


def _restore(model, snapshot) -> None:
    saved, kernels = snapshot
    state = dict(model.named_parameters())
    state.update(model.named_buffers())
    for name, tensor in saved.items():
        state[name].data.copy_(tensor)
    modules = dict(model.named_modules())
    for name, kernel in kernels.items():
        setattr(modules[name], _CPU_KERNEL, kernel)
    _refresh_tied_lm_head(model)


class VLLMWeightLoader:
    """Worker methods callable through `LLM.collective_rpc` (prefixed to avoid clashes). They
    return an error message instead of raising: vLLM's collective_rpc returns at the first worker
    that raises, and the other workers' replies would then answer the engine's next call."""

    def agm_receive_weights(self, receiver: dict) -> str | None:
        try:
            self._agm_receive(receiver_of(receiver))
        except Exception as exc:  # noqa: BLE001 - the engine raises it, once every worker answered
            return f"{type(exc).__name__}: {exc}"
        return None

    def _agm_receive(self, receiver: Receiver) -> None:
        """Loads the tensors into vLLM as they arrive over the receiver's transport (its loaders
        fuse QKV / gate-up, keep this worker's TP shard and redo post-load processing such as CPU
        weight packing), then keeps the version only if the transport agrees (a COMMIT that
        matches what arrived; over the collective, every member's vote); otherwise the previous
        weights are put back. Host memory: the snapshot of this worker's shard, the transport's
        buffers, and the tensors of the layers being loaded (vLLM holds a layer's tensors until
        it is complete)."""
        if not hasattr(self, "_agm_state"):
            self._agm_state = {}  # what a transport keeps from sync to sync (a collective group)
        incoming = receiver.open(self.rank, self._agm_state)
        try:
            error = self._agm_load(incoming.stream(self._agm_checkpoint_shapes()), keep=incoming.keep)
        except BaseException as exc:
            incoming.finish(exc)
            raise
        incoming.finish(error)
        if error is not None:
            raise error

    def _agm_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        if not hasattr(self, "_agm_shapes"):
            self._agm_shapes = checkpoint_shapes(self.vllm_config.model_config.model)
        return self._agm_shapes

    def _agm_load(self, stream, keep=lambda loaded: loaded) -> Exception | None:
        """Streams `stream` into the served model through vLLM's in-place reload, then asks
        `keep(loaded)` whether to keep the result; if not, or if the stream or the load failed,
        puts back the snapshot taken before. Returns the error (None when the version was kept)."""
        model = self.model_runner.get_model()
        snapshot = _snapshot(model)
        error = None
        try:
            self.reload_weights(weights_iterator=stream)
            _refresh_tied_lm_head(model)
        except Exception as exc:  # noqa: BLE001 - returned, after the rollback
            error = exc
            # vLLM's layerwise reload stopped with layers half-way: put its kernel tensors back first
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

            finalize_layerwise_reload(model, self.vllm_config.model_config)
        finally:
            stream.close()  # a stream left early still drains (collective) or ends its socket reads
        if keep(error is None) and error is None:
            return None
        _restore(model, snapshot)
        return error or SyncError("another member of the group did not take the version; previous weights restored")

    def agm_device_uuid(self) -> str | None:
        return device_id(self.rank)
