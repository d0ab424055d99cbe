"""Runs inside each vLLM worker process (mixed in through vLLM's `worker_extension_cls`)."""

from __future__ import annotations

import glob
import os

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


class VLLMWeightLoader:
    """Worker methods callable through `LLM.collective_rpc` (prefixed to avoid clashes). They
    return an error message instead of raising: vLLM's collective_rpc returns at the first worker
    that raises, and the other workers' replies would then answer the engine's next call."""

    def agm_receive_weights(self, receiver: dict) -> dict:
        """{"error": message or None, "dirty": whether any received tensor reached the model (a
        failed update then left it partly overwritten), "host_bytes": bytes received into host
        memory before the model took them}."""
        self._agm_dirty, self._agm_host_bytes = False, 0
        error = None
        try:
            self._agm_receive(receiver_of(receiver))
        except Exception as exc:  # noqa: BLE001 - the engine raises it, once every worker answered
            error = f"{type(exc).__name__}: {exc}"
        return {"error": error, "dirty": self._agm_dirty, "host_bytes": self._agm_host_bytes}

    def _agm_receive(self, receiver: Receiver) -> None:
        """Loads the tensors into vLLM as they arrive over the receiver's transport (its loaders
        fuse QKV / gate-up, keep this worker's TP shard and redo post-load processing such as CPU
        weight packing), then keeps the version only if the transport agrees (a COMMIT that
        matches what arrived; over the collective, every member's vote). No copy of the previous
        weights is kept: an update that fails after a tensor reached the model leaves them dirty
        (VLLMEngine then refuses to generate) until a later one commits. Host memory: the
        transport's buffers and the tensors of the layers being loaded (vLLM holds a layer's
        tensors until it is complete)."""
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

    def _agm_counted(self, stream):
        """`stream`, noting that the model is being written and the bytes that arrived in host memory."""
        for name, tensor in stream:
            self._agm_dirty = True
            if tensor.device.type == "cpu":
                self._agm_host_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def _agm_load(self, stream, keep=lambda loaded: loaded) -> Exception | None:
        """Streams `stream` into the served model through vLLM's in-place reload, then asks
        `keep(loaded)` whether to keep the result. Returns the error (None when the version was kept)."""
        model = self.model_runner.get_model()
        error = None
        try:
            self.reload_weights(weights_iterator=self._agm_counted(stream))
            _refresh_tied_lm_head(model)
        except Exception as exc:  # noqa: BLE001 - returned
            error = exc
            # vLLM's layerwise reload stopped with layers half-way (on the meta device): put its
            # kernel tensors back, so that the model can take the next update
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

            finalize_layerwise_reload(model, self.vllm_config.model_config)
        finally:
            stream.close()  # a stream left early still drains (collective) or ends its socket reads
        if keep(error is None) and error is None:
            return None
        return error or SyncError("another member of the group did not take the version")

    def agm_model_bytes(self) -> tuple[int, int]:
        """(parameter bytes, buffer bytes) of this worker's model: what a sleep moves (VLLMEngine)."""
        model = self.model_runner.get_model()
        return (sum(p.numel() * p.element_size() for p in model.parameters()),
                sum(b.numel() * b.element_size() for b in model.buffers()))

    def agm_device_uuid(self) -> str | None:
        return device_id(self.rank)
