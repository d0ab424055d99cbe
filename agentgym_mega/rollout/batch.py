"""The one record that flows from rollout to update: padded token tensors plus episode metadata.

A rollout fills the token fields; the actor adds `old_logprobs`, the reference `ref_logprobs`,
the critic `values`, the algorithms `advantages` and `returns`. Every stage reads and writes the
same structure, split along the batch dimension into mini-batches.
"""

from __future__ import annotations

import dataclasses

import torch

from agentgym_mega.rollout.status import UNTRAINED, Status

# The [B, T] fields a rollout fills, and those the later stages add.
ROLLOUT_FIELDS = ("input_ids", "attention_mask", "loss_mask", "rollout_logprobs", "rewards", "weight_versions")
LATER_FIELDS = ("old_logprobs", "ref_logprobs", "values", "advantages", "returns")


@dataclasses.dataclass
class Episode:
    task_id: int
    category: str
    group_id: int
    score: float  # the environment's episode score on [0, 1] (envs.server: episode_score)
    success: bool  # what the environment calls success (envs.server: success)
    turns: int
    status: Status
    response_tokens: int  # tokens the policy generated (the loss-masked ones)
    error: str | None = None
    valid_actions: int = 0  # replies the env server parsed as an action (envs.server: valid_action)
    # Its text, turn by turn (the first observation; each reply, the action read from it, the
    # observation and reward it got, tokens and seconds), for saved episodes (agentgym_mega.episodes).
    transcript: dict | None = None

    @property
    def trained(self) -> bool:
        return self.status not in UNTRAINED


class _Tensors:
    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields that are set, by name: what a model shard cuts into micro-batches."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


@dataclasses.dataclass
class PolicyUpdateBatch(_Tensors):
    """What one actor optimizer step reads of a mini-batch; sent to every trainer rank (through
    Ray's object store) without the rest of the record."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    attention_mask: torch.Tensor | None = None  # None: every position is a real token
    ref_logprobs: torch.Tensor | None = None  # with a KL loss


@dataclasses.dataclass
class ValueUpdateBatch(_Tensors):
    """What one critic optimizer step reads of a mini-batch (its values at rollout time as
    `old_values`, for the clipped value loss)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    old_values: torch.Tensor
    returns: torch.Tensor
    attention_mask: torch.Tensor | None = None  # None: every position is a real token


@dataclasses.dataclass
class TrajectoryBatch:
    input_ids: torch.Tensor  # [B, T] long, right-padded
    attention_mask: torch.Tensor  # [B, T] 1 on real tokens
    loss_mask: torch.Tensor  # [B, T] 1 on sampled assistant tokens and their end-of-turn token
    rollout_logprobs: torch.Tensor  # [B, T] engine log-probs on loss-masked tokens, 0 elsewhere
    rewards: torch.Tensor  # [B, T] the episode's score on its last loss-masked token
    group_ids: torch.Tensor  # [B] same value for samples of the same task
    scores: torch.Tensor  # [B] episode scores
    episodes: list[Episode]
    weight_versions: torch.Tensor | None = None  # [B, T] long: the weights version of each sampled token, -1 elsewhere
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def valid(self) -> torch.Tensor:
        """[B] bool: episodes that say something about the policy (not UNTRAINED)."""
        return torch.tensor([e.trained for e in self.episodes], dtype=torch.bool)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def for_policy_update(self) -> PolicyUpdateBatch:
        return PolicyUpdateBatch(self.input_ids, self.loss_mask, self.old_logprobs, self.advantages,
                                 attention_mask=self.attention_mask, ref_logprobs=self.ref_logprobs)

    def for_value_update(self) -> ValueUpdateBatch:
        return ValueUpdateBatch(self.input_ids, self.loss_mask, old_values=self.values, returns=self.returns,
                                attention_mask=self.attention_mask)

    def _tensor_fields(self):
        return [f.name for f in dataclasses.fields(self) if f.name != "episodes"]

    def select(self, index) -> "TrajectoryBatch":
        """Rows `index` (a slice, or a list/tensor of row numbers)."""
        rows = list(range(len(self)))[index] if isinstance(index, slice) else [int(i) for i in index]
        picked = {name: (t[rows] if t is not None else None)
                  for name, t in ((n, getattr(self, n)) for n in self._tensor_fields())}
        return TrajectoryBatch(**picked, episodes=[self.episodes[i] for i in rows])

    def split(self, parts: int) -> list["TrajectoryBatch"]:
        """`parts` consecutive chunks of equal size (the batch must divide evenly)."""
        if len(self) % parts:
            raise ValueError(f"a batch of {len(self)} does not split into {parts} equal parts")
        size = len(self) // parts
        return [self.select(slice(i * size, (i + 1) * size)) for i in range(parts)]

    def _require_rollout_only(self, what: str) -> None:
        later = [name for name in LATER_FIELDS if getattr(self, name) is not None]
        if later:
            raise ValueError(f"{what} takes a rollout batch; this one has {', '.join(later)} already")

    @classmethod
    def concat(cls, batches: list["TrajectoryBatch"], pad_id: int) -> "TrajectoryBatch":
        """The rows of `batches` in order, right-padded to the widest (ids with `pad_id`, the
        rest with 0); only the token fields a rollout fills may be set."""
        width = max(b.input_ids.shape[1] for b in batches)
        fields = {}
        for name in ROLLOUT_FIELDS:
            if getattr(batches[0], name) is None:
                continue
            fill = {"input_ids": pad_id, "weight_versions": -1}.get(name, 0)
            fields[name] = torch.cat([torch.nn.functional.pad(getattr(b, name), (0, width - b.input_ids.shape[1]),
                                                              value=fill) for b in batches])
        for b in batches:
            b._require_rollout_only("concat")
        return cls(**fields, group_ids=torch.cat([b.group_ids for b in batches]),
                   scores=torch.cat([b.scores for b in batches]),
                   episodes=[e for b in batches for e in b.episodes])

    def state(self) -> dict:
        """A rollout batch as tensors and plain values (torch.load's weights_only reads it back):
        a checkpoint keeps the rollout that the next step trains on (one-step off-policy)."""
        self._require_rollout_only("state")
        return {**{name: getattr(self, name) for name in ROLLOUT_FIELDS}, "group_ids": self.group_ids,
                "scores": self.scores,
                # the status as a plain str: weights_only loading refuses an enum class
                "episodes": [dataclasses.asdict(e) | {"status": str(e.status)} for e in self.episodes]}

    @classmethod
    def from_state(cls, state: dict) -> "TrajectoryBatch":
        return cls(**{k: v for k, v in state.items() if k != "episodes"},
                   episodes=[Episode(**e | {"status": Status(e["status"])}) for e in state["episodes"]])
