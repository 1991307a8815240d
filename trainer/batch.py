"""Turn trajectory groups into padded training tensors, and compute GRPO advantages.

Alignment: sequences are ``prompt + completion``, right-padded to length L. Every per-token
tensor of a ``TrainBatch`` has length ``L - 1`` and position ``j`` describes the *target* token
``input_ids[:, j + 1]``, exactly like the output of ``trainer.loss.sequence_logprobs``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Literal

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
    group_index: torch.Tensor  # long [N]; index of the sample's group in the input list

    @property
    def num_samples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())

    def select(self, rows: torch.Tensor) -> TrainBatch:
        """The sub-batch of the given sample rows (group indices are kept as they are)."""
        return TrainBatch(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})

    def minibatch_rows(self, count: int) -> list[torch.Tensor]:
        """Row indices of ``count`` minibatches of whole groups (sizes differ by at most one group)."""
        groups = torch.unique(self.group_index)
        chunks = [c for c in torch.tensor_split(groups, min(count, len(groups))) if c.numel()]
        return [torch.isin(self.group_index, c).nonzero().squeeze(-1) for c in chunks]


def collate(groups: list[TrajectoryGroup], pad_id: int) -> TrainBatch:
    """Pad every sample of every group into one ``TrainBatch``."""
    if not groups:
        raise ValueError("collate needs at least one trajectory group")
    seqs: list[tuple[list[int], int, slice, int, float]] = []
    for g_idx, group in enumerate(groups):
        prompt = group.prompt_tokens.tolist()
        for i in range(group.group_size):
            s = group.sample(i)
            seqs.append((prompt + group.completion_tokens[s].tolist(), len(prompt), s, g_idx, group.header.rewards[i]))
    length = max(len(seq) for seq, *_ in seqs)
    n = len(seqs)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    completion_mask = torch.zeros((n, length - 1), dtype=torch.float32)
    behaviour = torch.zeros((n, length - 1), dtype=torch.float32)
    versions = torch.full((n, length - 1), -1, dtype=torch.long)
    rewards = torch.zeros(n, dtype=torch.float32)
    group_index = torch.zeros(n, dtype=torch.long)
    for row, (seq, p_len, s, g_idx, reward) in enumerate(seqs):
        group = groups[g_idx]
        c_len = len(seq) - p_len
        input_ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attention_mask[row, : len(seq)] = 1
        span = slice(p_len - 1, p_len - 1 + c_len)  # target j+1 = completion token j - (p_len - 1)
        completion_mask[row, span] = torch.from_numpy(group.loss_mask[s].astype("float32"))
        behaviour[row, span] = torch.from_numpy(group.behaviour_logprobs[s].astype("float32"))
        versions[row, span] = torch.from_numpy(group.token_versions[s].astype("int64"))
        rewards[row] = float(reward)
        group_index[row] = g_idx
    return TrainBatch(input_ids, attention_mask, completion_mask, behaviour, versions, rewards, group_index)


def drop_zero_advantage(batch: TrainBatch, adv: torch.Tensor) -> tuple[TrainBatch, torch.Tensor]:
    """Keep only samples with a non-zero advantage (DAPO's filter of all-equal groups).

    With ``agg="token"`` and Adam this changes the update very little but saves the forward and
    backward passes of groups that carry no signal.
    """
    keep = (adv != 0).nonzero().squeeze(-1)
    return batch.select(keep), adv[keep]


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
