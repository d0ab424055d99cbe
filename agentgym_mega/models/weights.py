"""Moving weights between Hugging Face safetensors and a (TP/PP-sharded) megatron ``GPTModel``,
through the architecture's table in :mod:`agentgym_mega.models.mapping`.

* :func:`load_hf_weights`: every rank reads the slices of the HF tensors its parameters need.
* :func:`export_hf`: yields ``(hf_name, full tensor)`` on the model-parallel group's first rank,
  gathering TP shards and PP stages to it; the weight synchroniser streams these, :func:`save_hf`
  writes them.

The critic (a :class:`~agentgym_mega.models.gpt.ValueHead` in place of the LM head) starts from
the policy's HF weights, its head excepted, and exports as Hugging Face's per-token scalar model,
``<Arch>ForTokenClassification`` with one label: the same backbone tensors, no ``lm_head``, and
``score.weight``/``score.bias`` (a ``Linear(hidden, 1)`` on the final norm's output, which is what
the value head is), so ``AutoModelForTokenClassification`` reproduces the critic's values.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import types
import weakref
from typing import Iterator

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from agentgym_mega import files
from agentgym_mega.models import gpt, mapping
from agentgym_mega.models.mapping import MappingError

# megatron is imported inside the functions that use it: the trainer's driver imports this module
# (through `checkpoint`) and never builds a model.

SAFETENSORS_INDEX = "model.safetensors.index.json"
SHARD_BYTES = 2 << 30
# Files of an HF model directory that are weights; everything else (config, tokenizer, chat
# template, generation config) travels with exported weights unchanged.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", SAFETENSORS_INDEX)


def unwrap(model):
    """The GPTModel inside megatron's DDP (and any other ``.module`` wrapper)."""
    while hasattr(model, "module"):
        model = model.module
    return model


class HFCheckpoint:
    """Lazy, shape-checked access to the tensors of an HF safetensors directory."""

    def __init__(self, hf_dir: str, geometry: mapping.Geometry):
        self.dir, self.geometry = hf_dir, geometry
        index = os.path.join(hf_dir, SAFETENSORS_INDEX)
        single = os.path.join(hf_dir, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                self.files = {k: os.path.join(hf_dir, v) for k, v in json.load(f)["weight_map"].items()}
        elif os.path.exists(single):
            with safe_open(single, framework="pt") as f:
                self.files = {k: single for k in f.keys()}
        else:
            raise MappingError(f"{hf_dir}: no model.safetensors or {SAFETENSORS_INDEX}")

    def get(self, name: str, part: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The tensor ``name``, or only ``part`` of it (``(dim, start, stop)``, see
        :func:`mapping.shard_reads`): a slice read from the file, never the whole tensor."""
        if name not in self.files:
            raise MappingError(f"{name}: missing from {self.dir}")
        with safe_open(self.files[name], framework="pt") as f:
            view = f.get_slice(name)
            shape, expected = tuple(view.get_shape()), self.geometry.hf_shape(name)
            if shape != expected:
                raise MappingError(f"{name}: shape {shape} in {self.files[name]}, config.json implies {expected}")
            if part is None:
                return view[:]
            dim, start, stop = part
            return view[(slice(None),) * dim + (slice(start, stop),)]


def global_rules(hf_config, te_spec: bool) -> dict[str, mapping.Rule]:
    """Every rule with its layer filled in, keyed by megatron name with the global layer index."""
    layers = hf_config.num_hidden_layers
    out = {}
    for rule in mapping.rules(hf_config, te_spec):
        for layer in range(layers) if rule.per_layer else [None]:
            filled = rule.at(layer)
            out[filled.megatron] = filled
    return out


def named_global_params(model) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """This rank's parameters, named with global layer indices (megatron names are stage-local)."""
    model = unwrap(model)
    for name, param in model.named_parameters():
        if name.startswith("decoder.layers."):
            local, rest = name.removeprefix("decoder.layers.").split(".", 1)
            layer = model.decoder.layers[int(local)].layer_number - 1  # layer_number is global, 1-based
            name = f"decoder.layers.{layer}.{rest}"
        yield name, param


def _geometry(hf_config, model) -> mapping.Geometry:
    return mapping.Geometry.of(hf_config, padded_vocab=unwrap(model).vocab_size)


def has_value_head(model) -> bool:
    """A critic's model, on every pipeline stage (only the last one holds the head itself)."""
    return isinstance(unwrap(model), gpt.value_gpt_model())


def _is_value_head(model, name: str) -> bool:
    return has_value_head(model) and name.startswith("output_layer.")


# The value head as HF's token-classification ``score`` layer (see the module docstring).
VALUE_HEAD_RULES = (
    mapping.Rule("output_layer.weight", ("score.weight",), "replicated"),
    mapping.Rule("output_layer.bias", ("score.bias",), "replicated"),
)


def export_rules(model, hf_config) -> dict[str, mapping.Rule]:
    """:func:`global_rules` for what ``model`` holds: a critic has no LM head (nor a tied one)
    but the value head, last."""
    rules = global_rules(hf_config, gpt.te_available())
    if has_value_head(model):
        rules.pop("output_layer.weight")
        rules.update((rule.megatron, rule) for rule in VALUE_HEAD_RULES)
    return rules


def _hf_shape(geo: mapping.Geometry, name: str) -> tuple[int, ...]:
    return {"score.weight": (1, geo.hidden), "score.bias": (1,)}.get(name) or geo.hf_shape(name)


def value_model_config(hf_config: dict) -> dict:
    """The HF ``config.json`` of an exported critic, from the policy's: the architecture's
    ``ForTokenClassification`` class with one label (the value), its ``score`` layer biased."""
    policy = mapping.architecture(types.SimpleNamespace(architectures=hf_config.get("architectures"))).hf_name
    return dict(hf_config, architectures=[policy.removesuffix("ForCausalLM") + "ForTokenClassification"],
                id2label={"0": "value"}, label2id={"value": 0}, token_classification_bias=True,
                tie_word_embeddings=False)


@torch.no_grad()
def load_hf_weights(model, hf_dir: str, hf_config) -> None:
    """Fills this rank's shard of every parameter from an HF directory (the critic's value head
    excepted), reading from each file only the slices the shard needs. Stops at the first tensor
    that is missing or of the wrong shape, naming it."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    geo = _geometry(hf_config, model)
    source = HFCheckpoint(hf_dir, geo)
    rules = global_rules(hf_config, gpt.te_available())
    for name, param in named_global_params(model):
        if _is_value_head(model, name):
            continue
        if name not in rules:
            table = mapping.architecture(hf_config).hf_name
            raise MappingError(f"{name}: megatron parameter with no rule in the {table} table")
        rule = rules[name]
        parts = mapping.shard_reads(rule, geo, tp_rank, tp_size)
        mapping.assemble(rule, [source.get(h, p) for h, p in zip(rule.hf, parts)], geo, tp_size, out=param)


def _stage_of_each_param(local_names: set[str]) -> dict[str, int]:
    """Which pipeline stage holds each parameter (the first one, for PP-tied LM heads)."""
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    per_stage = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_stage, sorted(local_names), group=group)
    owner = {}
    for stage, names in enumerate(per_stage):
        for name in names:
            owner.setdefault(name, stage)
    return owner


EXPORT_TO = ("first", "stage", "every")
# On CPU, per model, the tensors a holder assembled in its last export, filled again by the next:
# fresh memory page-faults at every sync, which costs about as much as the transfer on a CPU host
# (the CUDA caching allocator already hands freed blocks back without that cost).
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Tensors whose TP gather is in flight while the consumer (a sender streaming them, a writer)
# handles the one before: their transfer overlaps its work and the assembling of the one before.
_LOOKAHEAD = 1


@dataclasses.dataclass
class _TPGather:
    """This rank's side of one export's TP gathers: the group, which TP indices assemble full
    tensors (`holders`), and how shards travel to them (`p2p`, see :func:`_post_gather`)."""

    group: object
    ranks: list[int]
    me: int  # this rank's TP index
    holders: tuple[int, ...]
    p2p: bool
    geo: mapping.Geometry
    kept: dict | None  # on CPU, the assembled tensors of the last export (see export_hf)
    scratch: dict = dataclasses.field(default_factory=dict)  # receive buffers of the layouts to_hf assembles
    posted: int = 0  # gathers into scratch so far: consecutive ones take different slots

    @property
    def holds(self) -> bool:
        return self.me in self.holders

    def empty(self, key: tuple, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """An output tensor: the last export's of the same `key` where one is kept."""
        if self.kept is None:
            return like.new_empty(shape)
        out = self.kept.get(key)
        if out is None or out.shape != shape or out.dtype != like.dtype:
            out = self.kept[key] = like.new_empty(shape)
        return out

    def buffers(self, like: torch.Tensor) -> list[torch.Tensor]:
        """Receive buffers for one shard from each TP rank, reused from layer to layer (fresh pages
        are slow to fault in): a set per tensor that can be in flight at once."""
        slot, self.posted = self.posted % (_LOOKAHEAD + 1), self.posted + 1
        key = (tuple(like.shape), like.dtype, slot)
        if key not in self.scratch:
            self.scratch[key] = [torch.empty_like(like) for _ in self.ranks]
        return self.scratch[key]


def _pieces(rule: mapping.Rule, shard: torch.Tensor) -> list[torch.Tensor]:
    """The parts of a (contiguous) TP shard that each fill one block of rows of an HF tensor:
    gate_up's gate and up halves, the whole shard otherwise."""
    return list(shard.chunk(2, 0)) if rule.layout == "gate_up" else [shard]


def _in_place(rule: mapping.Rule, shard: torch.Tensor, tp: _TPGather):
    """For the layouts whose shards are blocks of rows of the HF tensors (vocab, gate_up): the
    HF tensors, empty, and per TP rank the blocks its :func:`_pieces` fill, so shards land where
    they belong with no copy after. None for qkv (rows interleave per query group) and row
    (shards are column blocks): :func:`mapping.to_hf` assembles those."""
    rows, tail, n = shard.shape[0], tuple(shard.shape[1:]), len(tp.ranks)
    if rule.layout == "vocab":
        padded = tp.empty((rule.megatron, 0), (rows * n, *tail), shard)
        return [padded[: tp.geo.vocab]], [[padded[r * rows : (r + 1) * rows]] for r in range(n)]
    if rule.layout == "gate_up":
        half = rows // 2
        gate, up = (tp.empty((rule.megatron, k), (half * n, *tail), shard) for k in range(2))
        return [gate, up], [[gate[r * half : (r + 1) * half], up[r * half : (r + 1) * half]] for r in range(n)]
    return None


def _assemble(rule: mapping.Rule, shards: list[torch.Tensor], tp: _TPGather) -> list[torch.Tensor]:
    """mapping.to_hf of the received shards, a row layout's into a kept tensor."""
    if rule.layout == "row":
        shape = (shards[0].shape[0], sum(s.shape[1] for s in shards), *shards[0].shape[2:])
        return [torch.cat(shards, 1, out=tp.empty((rule.megatron, 0), shape, shards[0]))]
    return mapping.to_hf(rule, shards, tp.geo)


def _post_gather(rule: mapping.Rule, local: torch.Tensor, tp: _TPGather, index: int):
    """Starts moving one parameter's TP shards to the holders, without waiting; the returned
    call waits for them and returns the full HF tensors on a holder, None elsewhere. `index`:
    the parameter's position in the export, the same on every rank.

    Over gloo, shards go point to point into their final place (holders receive, the others
    send; a holder's own shard is read where it is): gloo's gather and all-gather would stage
    the whole tensor in a fresh flat buffer and copy out of it. Other backends (NCCL) gather
    with the backend's own collective, into the same places."""
    n = len(tp.ranks)
    if n == 1 or rule.layout == "replicated":  # replicated: every rank has it
        return lambda: mapping.to_hf(rule, [local], tp.geo) if tp.holds else None
    local = local.contiguous()
    pieces = _pieces(rule, local)
    outputs, blocks = None, None
    if tp.holds:
        outputs, blocks = _in_place(rule, local, tp) or (None, None)
        if blocks is None:
            blocks = [[b] for b in tp.buffers(local)]
            if tp.p2p:
                blocks[tp.me] = [local]
    works = []
    for k, piece in enumerate(pieces):
        column = [b[k] for b in blocks] if blocks else None
        if tp.p2p:
            tag = 2 * index + k  # gate_up's two halves (k) travel apart
            if tp.holds:
                works += [dist.irecv(column[r], src=tp.ranks[r], group=tp.group, tag=tag)
                          for r in range(n) if r != tp.me]
            works += [dist.isend(piece, dst=tp.ranks[h], group=tp.group, tag=tag) for h in tp.holders if h != tp.me]
        elif len(tp.holders) == n:
            works.append(dist.all_gather(column, piece, group=tp.group, async_op=True))
        else:
            works.append(dist.gather(piece, column, dst=tp.ranks[tp.holders[0]], group=tp.group, async_op=True))

    def finish() -> list[torch.Tensor] | None:
        if tp.p2p and outputs is not None:  # the own pieces into their blocks, while the others arrive
            for block, piece in zip(blocks[tp.me], pieces):
                block.copy_(piece)
        for work in works:
            work.wait()
        if not tp.holds:
            return None
        return outputs if outputs is not None else _assemble(rule, [b[0] for b in blocks], tp)

    return finish


@torch.no_grad()
def export_hf(model, hf_config, to: str = "first") -> Iterator[tuple[str, torch.Tensor]]:
    """Yields every HF tensor, full and unpadded, in a fixed order. A collective: all TP and PP
    ranks must drain the iterator together. Which ranks yield, `to`:

    * ``first``: the model-parallel group's first rank (TP rank 0 of PP stage 0), the others
      nothing. Only that rank needs the tensors (it writes or streams them), so TP shards are
      gathered to it alone and other stages send it theirs.
    * ``stage``: the first TP rank of every stage, its own stage's tensors (each stage then
      sends its own, at once).
    * ``every``: every rank, every tensor (TP shards all-gathered, other stages' tensors
      broadcast): each rank feeds the engine worker on its own GPU.

    The TP gather of the next tensor is under way while the consumer handles one (see
    :func:`_post_gather`). Use the tensors before the weights change and before the next
    export: at TP=1 they can be views of the parameters, and on CPU a holder fills the same
    tensors at every export (`_KEPT`)."""
    from megatron.core import parallel_state

    if to not in EXPORT_TO:
        raise ValueError(f"export_hf(to={to!r}): allowed {', '.join(EXPORT_TO)}")
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_ranks = dist.get_process_group_ranks(tp_group)
    geo = _geometry(hf_config, model)
    params = dict(named_global_params(model))
    owner = _stage_of_each_param(set(params))
    sample = next(iter(params.values()))
    kept = _KEPT.setdefault(unwrap(model), {}) if sample.device.type == "cpu" else None
    tp = _TPGather(tp_group, tp_ranks, parallel_state.get_tensor_model_parallel_rank(),
                   tuple(range(len(tp_ranks))) if to == "every" else (0,), dist.get_backend(tp_group) == "gloo", geo,
                   kept)
    pp = _Stages(parallel_state.get_pipeline_model_parallel_group(), parallel_state.get_pipeline_model_parallel_rank(),
                 to, tp.me == 0)
    in_flight = collections.deque()
    for index, (name, rule) in enumerate(export_rules(model, hf_config).items()):
        if not rule.exported:
            continue
        if name not in owner:
            raise MappingError(f"{name}: held by no pipeline stage")
        mine = owner[name] == pp.me
        in_flight.append((rule, owner[name], _post_gather(rule, params[name].detach(), tp, index) if mine else None))
        if len(in_flight) > _LOOKAHEAD:
            yield from pp.deliver(*in_flight.popleft(), geo, sample)
    while in_flight:
        yield from pp.deliver(*in_flight.popleft(), geo, sample)


class _Stages:
    """The pipeline-stage side of an export: which stage's tensors this rank yields, and the
    sends or broadcasts that bring other stages' tensors to it."""

    def __init__(self, group, me: int, to: str, first_in_tp: bool):
        self.group, self.me, self.to, self.first_in_tp = group, me, to, first_in_tp
        self.ranks = dist.get_process_group_ranks(group)

    def deliver(self, rule: mapping.Rule, owner: int, gathered, geo: mapping.Geometry, sample: torch.Tensor):
        """Finishes one parameter's TP gather (`gathered`: from :func:`_post_gather`, None on
        other stages) and yields its HF tensors where `to` wants them."""
        tensors = gathered() if gathered is not None else None
        every = self.to == "every"

        def empty():
            return [torch.empty(_hf_shape(geo, h), dtype=sample.dtype, device=sample.device) for h in rule.hf]

        if every and len(self.ranks) > 1:
            tensors = [t.contiguous() for t in tensors] if owner == self.me else empty()
            for t in tensors:
                dist.broadcast(t, src=self.ranks[owner], group=self.group)
        elif self.to == "first" and self.first_in_tp and owner != 0:
            if self.me == owner:
                for t in tensors:
                    dist.send(t.contiguous(), dst=self.ranks[0], group=self.group)
            elif self.me == 0:
                tensors = empty()
                for t in tensors:
                    dist.recv(t, src=self.ranks[owner], group=self.group)
        if every or (self.first_in_tp and self.me == (owner if self.to == "stage" else 0)):
            yield from zip(rule.hf, tensors)


def copy_side_files(src: str, dst: str) -> None:
    """Copies config, tokenizer and generation files of an HF directory, not its weights."""
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, os.path.join(dst, name))


def save_hf(model, hf_config, side_files_dir: str, out: str, shard_bytes: int = SHARD_BYTES) -> str | None:
    """Writes the model as an HF directory (safetensors shards + index, config, tokenizer) at
    ``out``, atomically; a critic as its token-classification model (see the module docstring).
    Collective; global rank 0 writes. Returns ``out`` on rank 0."""
    writer = dist.get_rank() == 0
    tmp = files.atomic_dir(out) if writer else None
    shards, current, size, weight_map = [], {}, 0, {}

    def flush():
        nonlocal current, size
        if current:
            shards.append(current)
            current, size = {}, 0

    for name, tensor in export_hf(model, hf_config):
        if not writer:
            continue
        if size and size + tensor.nbytes > shard_bytes:
            flush()
        current[name] = tensor.cpu().clone()
        size += tensor.nbytes
    if writer:
        flush()
        total = sum(t.nbytes for s in shards for t in s.values())
        for i, shard in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(tmp, file), metadata={"format": "pt"})
            weight_map.update({name: file for name in shard})
        with open(os.path.join(tmp, SAFETENSORS_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        copy_side_files(side_files_dir, tmp)
        if has_value_head(model):
            config_path = os.path.join(tmp, "config.json")
            with open(config_path) as f:
                config = value_model_config(json.load(f))
            with open(config_path, "w") as f:
                json.dump(config, f, indent=2)
        files.commit_dir(tmp, out)
    dist.barrier()
    return out if writer else None
