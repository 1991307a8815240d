"""Turn trajectory groups into padded training tensors, and compute GRPO advantages.

Alignment: sequences are ``prompt + completion``, right-padded to length L. Every per-token
tensor of a ``TrainBatch`` has length ``L - 1`` and position ``j`` describes the *target* token
``input_ids[:, j + 1]``, exactly like the output of ``trainer.loss.sequence_logprobs``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Literal

import numpy as np
import torch

from broker.schema import TrajectoryGroup

logger = logging.getLogger(__name__)


@dataclass
class TrainBatch:
    """N samples (all samples of all groups, group after group)."""

    input_ids: torch.Tensor  # long [N, L], right-padded with pad_id
    attention_mask: torch.Tensor  # long [N, L]
    completion_mask: torch.Tensor  # float [N, L-1]; 1 = completion token with loss_mask 1
    behaviour_logprobs: torch.Tensor  # float [N, L-1]; 0 outside completions
    token_versions: torch.Tensor  # long [N, L-1]; -1 outside completions
    rewards: torch.Tensor  # float [N]
    group_index: torch.Tensor  # long [N]; the sample's set of compared samples: its group, or its group's subgroup
    prompt_lengths: torch.Tensor  # long [N]; the prompt is input_ids[i, :prompt_lengths[i]]
    step_node: torch.Tensor  # long [N, L-1]; the token's turn's node in its group's trajectory graph, -1: none
    step_bonus: torch.Tensor  # float [N, L-1]; a step-level advantage added to the token's (GiGPO), 0: none
    routing: torch.Tensor | None = None
    """int16 [N, L, layers, top_k] (int16: at 512 samples of 4k tokens, 48 layers, top-8, it is 1.6 GB; long would
    be 6.4): the experts recorded for input position j (``input_ids[:, j]``), -1 where
    none was recorded (routed live); None: no routing (a dense policy, or records without it)."""

    @property
    def num_samples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())

    def to(self, device: torch.device | str) -> TrainBatch:
        """The batch on ``device``."""
        return TrainBatch(**{f.name: _apply(getattr(self, f.name), lambda t: t.to(device)) for f in fields(self)})

    def select(self, rows: torch.Tensor) -> TrainBatch:
        """The sub-batch of the given sample rows (group indices are kept as they are)."""
        return TrainBatch(**{f.name: _apply(getattr(self, f.name), lambda t: t[rows]) for f in fields(self)})

    def minibatch_rows(self, count: int) -> list[torch.Tensor]:
        """Row indices of ``count`` minibatches of whole groups (sizes differ by at most one group)."""
        groups = torch.unique(self.group_index)
        chunks = [c for c in torch.tensor_split(groups, min(count, len(groups))) if c.numel()]
        return [torch.isin(self.group_index, c).nonzero().squeeze(-1) for c in chunks]


def _apply(value: torch.Tensor | None, fn):
    return None if value is None else fn(value)


def collate(groups: list[TrajectoryGroup], pad_id: int) -> TrainBatch:
    """Pad every sample of every group into one ``TrainBatch`` (one block of rows per group)."""
    if not groups:
        raise ValueError("collate needs at least one trajectory group")
    sizes = np.array([g.group_size for g in groups])
    p_lens = np.array([len(g.prompt_tokens) for g in groups])
    c_lens = [np.diff(g.completion_offsets.astype(np.int64)) for g in groups]
    n, length = int(sizes.sum()), int(max((p + c).max() for p, c in zip(p_lens, c_lens, strict=True)))
    input_ids = np.full((n, length), pad_id, dtype=np.int64)
    attention_mask = np.zeros((n, length), dtype=np.int64)
    completion_mask = np.zeros((n, length - 1), dtype=np.float32)
    behaviour = np.zeros((n, length - 1), dtype=np.float32)
    versions = np.full((n, length - 1), -1, dtype=np.int64)
    step_node = np.full((n, length - 1), -1, dtype=np.int64)
    step_bonus = np.zeros((n, length - 1), dtype=np.float32)
    routing = _routing_array(groups, n, length)
    first, nodes_before = 0, 0
    for group, size, p_len, c_len in zip(groups, sizes, p_lens, c_lens, strict=True):
        block = slice(first, first + size)
        input_ids[block, :p_len] = group.prompt_tokens
        # Completion token k of sample s sits at column p_len + k; its per-token values describe
        # that token as a target, at column p_len - 1 + k.
        offsets = group.completion_offsets.astype(np.int64)
        flat = np.arange(offsets[0], offsets[-1])
        rows = first + np.repeat(np.arange(size), c_len)
        cols = p_len + flat - np.repeat(offsets[:-1], c_len)
        input_ids[rows, cols] = group.completion_tokens[flat]
        completion_mask[rows, cols - 1] = group.loss_mask[flat]
        behaviour[rows, cols - 1] = group.behaviour_logprobs[flat]
        versions[rows, cols - 1] = group.token_versions[flat]
        attention_mask[block] = np.arange(length) < (p_len + c_len)[:, None]
        if routing is not None:  # by input position: the prompt's are its samples', token k's is at p_len - 1 + k
            routing[block, : p_len - 1] = group.routed_experts[: p_len - 1]
            routing[rows, cols - 1] = group.routed_experts[p_len - 1 + flat]
        if group.header.turn_nodes is not None:
            for i, (spans, nodes) in enumerate(zip(group.header.turns, group.header.turn_nodes, strict=True)):
                for (start, end), node in zip(spans, nodes, strict=True):
                    step_node[first + i, p_len - 1 + start : p_len - 1 + end] = nodes_before + node
            nodes_before += 1 + max((n for row in group.header.turn_nodes for n in row), default=-1)
        if group.header.turn_advantages is not None:
            for i, (spans, bonus) in enumerate(zip(group.header.turns, group.header.turn_advantages, strict=True)):
                for (start, end), value in zip(spans, bonus, strict=True):
                    step_bonus[first + i, p_len - 1 + start : p_len - 1 + end] = value
        first += size
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        completion_mask=torch.from_numpy(completion_mask),
        behaviour_logprobs=torch.from_numpy(behaviour),
        token_versions=torch.from_numpy(versions),
        rewards=torch.tensor([r for g in groups for r in g.header.rewards], dtype=torch.float32),
        group_index=torch.from_numpy(_compared_sets(groups)),
        prompt_lengths=torch.from_numpy(np.repeat(p_lens, sizes).astype(np.int64)),
        step_node=torch.from_numpy(step_node),
        step_bonus=torch.from_numpy(step_bonus),
        routing=None if routing is None else torch.from_numpy(routing),
    )


def _routing_array(groups: list[TrajectoryGroup], n: int, length: int) -> np.ndarray | None:
    """An all -1 int16 [n, length, layers, top_k] for the groups' routing, or None when none carries
    routing; groups with and without routing, or of different routing shapes, are refused."""
    shapes = [g.header.routing for g in groups]
    if all(s is None for s in shapes):
        return None
    if any(s is None for s in shapes) or any(s != shapes[0] for s in shapes):
        kinds = sorted({"none" if s is None else f"{s.layers} layers x top-{s.top_k} of {s.num_experts}"
                        for s in shapes})
        raise ValueError(f"groups of different routing in one batch ({'; '.join(kinds)}): a batch holds one "
                         "mixture-of-experts policy's groups, all recorded with its routing or all without")
    for g in groups:
        want = (len(g.prompt_tokens) - 1 + len(g.completion_tokens), shapes[0].layers, shapes[0].top_k)
        if g.routed_experts is None or g.routed_experts.shape != want:
            got = None if g.routed_experts is None else g.routed_experts.shape
            raise ValueError(f"group {g.header.group_id}: routed_experts of shape {got}, where its header's routing "
                             f"needs {want}")
    return np.full((n, length, shapes[0].layers, shapes[0].top_k), -1, dtype=np.int16)


def _compared_sets(groups: list[TrajectoryGroup]) -> np.ndarray:
    """Per sample, a number shared by exactly the samples its advantage compares it with: those of
    its group, or of its group's subgroup when the group has subgroups."""
    parts, first = [], 0
    for group in groups:
        if group.header.subgroups is None:
            parts.append(np.full(group.group_size, first, dtype=np.int64))
            first += 1
        else:
            _, local = np.unique(np.asarray(group.header.subgroups), return_inverse=True)
            parts.append(first + local.astype(np.int64))
            first += int(local.max()) + 1
    return np.concatenate(parts)


def drop_zero_advantage(batch: TrainBatch, adv: torch.Tensor) -> tuple[TrainBatch, torch.Tensor]:
    """Keep only samples with a non-zero advantage (DAPO's filter of all-equal groups).

    With ``agg="token"`` and Adam this changes the update very little but saves the forward and
    backward passes of groups that carry no signal.
    """
    nonzero = adv != 0
    keep = (nonzero if adv.dim() == 1 else nonzero.any(-1)).nonzero().squeeze(-1)
    return batch.select(keep), adv[keep]


def step_advantages(adv: torch.Tensor, step_node: torch.Tensor, step_bonus: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token advantages [N, L-1] from per-sample ones [N] (``adv`` itself when no token has a
    node or a bonus): a token of a turn with a graph node (``step_node`` ≥ 0) gets the mean
    advantage of the samples through that node (each sample once, however often it passes); every
    other token its sample's advantage; ``step_bonus`` (a step-level advantage per token) is added."""
    on = step_node >= 0
    bonus = step_bonus is not None and bool(step_bonus.any())
    if not bool(on.any()):
        return adv[:, None] + step_bonus if bonus else adv  # no graph: the sample's advantage, as [N]
    per_token = adv[:, None].expand_as(step_node).clone()
    rows = torch.arange(step_node.shape[0])[:, None].expand_as(step_node)[on]
    pairs = torch.unique(torch.stack([step_node[on], rows]), dim=1)
    n_nodes = int(pairs[0].max()) + 1
    total = torch.zeros(n_nodes, dtype=adv.dtype).index_add_(0, pairs[0], adv[pairs[1]])
    count = torch.zeros(n_nodes, dtype=adv.dtype).index_add_(0, pairs[0], torch.ones_like(adv[pairs[1]]))
    per_token[on] = (total / count.clamp(min=1))[step_node[on]]
    return per_token + step_bonus if bonus else per_token


def advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    scale: Literal["std", "none"] = "std",
    eps: float = 1e-6,
) -> torch.Tensor:
    """GRPO advantages [N]: reward minus its group's mean, divided by the group's std if asked.

    The std is the unbiased sample std; a group whose rewards are all equal (or of size one) gets
    zero advantage for every sample.
    """
    rewards = rewards.float()
    n_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    counts = torch.zeros(n_groups).index_add_(0, group_index, torch.ones_like(rewards))
    means = torch.zeros(n_groups).index_add_(0, group_index, rewards) / counts.clamp(min=1)
    centred = rewards - means[group_index]
    if scale == "none":
        return centred
    if scale != "std":
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    sq = torch.zeros(n_groups).index_add_(0, group_index, centred**2)
    std = (sq / (counts - 1).clamp(min=1)).sqrt()
    return centred / (std[group_index] + eps)
