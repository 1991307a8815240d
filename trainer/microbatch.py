"""Micro-batches: an update's samples packed into forward/backward passes of at most a token budget,
dealt to the trainer's ranks; their gradients accumulate into one optimizer update.

A micro-batch's cost is the tokens its forward runs, padding included: rows × longest sequence for
the plain forward; for the shared-prefix forward, each group's prompt once (as long as the longest
prompt) plus rows × longest completion. Samples are taken in order (a group's samples stay
together, which the shared prefix needs); one longer than the budget is a micro-batch of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from trainer.batch import TrainBatch

CPU_MICRO_BATCH_TOKENS = 8192
"""Default budget on a CPU, where host memory is the limit and small models are the rule."""
GIB = 1 << 30


@dataclass(frozen=True)
class MicroBatch:
    rows: torch.Tensor  # rows of the update's batch
    live: bool = True  # False: a stand-in with no trained token, run so that every rank runs as many passes


@dataclass(frozen=True)
class _Shape:
    """What a forward's cost depends on: samples, the longest sequence, prompt and completion, and
    the runs of samples of one group (each prompt the shared prefix runs)."""

    samples: int = 0
    longest: int = 0
    prompt: int = 0
    completion: int = 0
    runs: int = 0

    def grown(self, length: int, prompt: int, new_run: bool) -> _Shape:
        return _Shape(self.samples + 1, max(self.longest, length), max(self.prompt, prompt),
                      max(self.completion, length - prompt), self.runs + new_run)

    def cost(self, shared_prefix: bool) -> int:
        if shared_prefix:
            return self.runs * self.prompt + self.samples * self.completion
        return self.samples * self.longest


def cost(prompt_lengths: list[int], lengths: list[int], groups: list[int], shared_prefix: bool) -> int:
    """Tokens a forward over these samples runs (padding included)."""
    shape = _Shape()
    for i, (length, prompt) in enumerate(zip(lengths, prompt_lengths, strict=True)):
        shape = shape.grown(length, prompt, i == 0 or groups[i - 1] != groups[i])
    return shape.cost(shared_prefix)


def tokens(batch: TrainBatch, rows: list[int], *, shared_prefix: bool) -> int:
    """``cost`` of one forward over ``rows`` of ``batch``."""
    lengths = batch.attention_mask.sum(1)
    return cost(batch.prompt_lengths[rows].tolist(), lengths[rows].tolist(), batch.group_index[rows].tolist(),
                shared_prefix)


def pack(batch: TrainBatch, rows: list[int], budget: int, *, shared_prefix: bool) -> list[list[int]]:
    """``rows`` in order, cut into runs whose ``cost`` stays within ``budget`` tokens."""
    lengths = batch.attention_mask.sum(1).tolist()
    prompts = batch.prompt_lengths.tolist()
    groups = batch.group_index.tolist()
    out: list[list[int]] = []
    current: list[int] = []
    shape = _Shape()  # of ``current``, kept as it grows
    for row in rows:
        grown = shape.grown(lengths[row], prompts[row], not current or groups[current[-1]] != groups[row])
        if current and grown.cost(shared_prefix) > budget:
            out.append(current)
            current, grown = [], _Shape().grown(lengths[row], prompts[row], True)
        current.append(row)
        shape = grown
    if current:
        out.append(current)
    return out


def split_for_ranks(batch: TrainBatch, rows: list[int], world: int) -> list[list[int]]:
    """``rows`` in order, cut into ``world`` contiguous parts of about equal tokens (some may be empty)."""
    if world == 1:
        return [rows]
    lengths = batch.attention_mask.sum(1)[rows].tolist() if rows else []
    total = float(sum(lengths))
    parts: list[list[int]] = [[] for _ in range(world)]
    seen = 0.0
    for row, length in zip(rows, lengths):
        part = min(int(world * (seen + length / 2) / max(total, 1.0)), world - 1)
        parts[part].append(row)
        seen += length
    return parts


def plan(batch: TrainBatch, budget: int, *, shared_prefix: bool, world: int = 1, rank: int = 0) -> list[MicroBatch]:
    """This rank's micro-batches over every row of ``batch``: its part of the rows, packed by
    ``budget``, then stand-ins up to the largest count any rank has (every rank runs as many passes:
    each pass of a sharded model is a collective)."""
    rows = list(range(batch.num_samples))
    packed = [pack(batch, part, budget, shared_prefix=shared_prefix) for part in split_for_ranks(batch, rows, world)]
    longest = max(len(p) for p in packed)
    mine = [MicroBatch(torch.tensor(r, dtype=torch.long)) for r in packed[rank]]
    stand_in = MicroBatch(torch.zeros(1, dtype=torch.long), live=False)
    return mine + [stand_in] * (longest - len(mine))


def trimmed(batch: TrainBatch, *extra: torch.Tensor) -> tuple[TrainBatch, ...]:
    """``batch`` cut to its longest sequence (a micro-batch's rows are often shorter than the update's),
    and ``extra`` per-token tensors [N, L−1] of the same rows cut alike."""
    length = batch.input_ids.shape[1]
    width = max(int(batch.attention_mask.sum(1).max()), 2)

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None or t.dim() < 2:
            return t
        return t[:, :width] if t.shape[1] == length else t[:, : width - 1]

    return (TrainBatch(**{f.name: cut(getattr(batch, f.name)) for f in fields(batch)}), *(cut(t) for t in extra))


def without_training(batch: TrainBatch) -> TrainBatch:
    """A stand-in micro-batch: the same rows with no trained token."""
    return TrainBatch(**{**{f.name: getattr(batch, f.name) for f in fields(batch)},
                         "completion_mask": torch.zeros_like(batch.completion_mask)})


def default_micro_batch_tokens(lm: torch.nn.Module, device: torch.device, *, bf16: bool, checkpointing: bool,
                               world: int = 1) -> int:
    """A token budget for ``lm`` on ``device``: on a GPU, half its memory less the sharded training
    state (float32 weights, gradients and two AdamW moments: 16 bytes a parameter) and a reserve for
    the LM head's chunks, over an estimate of the activations a token keeps per decoder layer
    ((16 · hidden + 4 · intermediate) values; with checkpointing only each layer's input and one
    layer's worth); on a CPU ``CPU_MICRO_BATCH_TOKENS``."""
    if device.type != "cuda":
        return CPU_MICRO_BATCH_TOKENS
    text = lm.config.get_text_config()
    hidden = int(text.hidden_size)
    inter = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    layers = int(text.num_hidden_layers)
    width = 2 if bf16 else 4
    per_layer = (16 * hidden + 4 * inter) * width
    per_token = layers * hidden * width + per_layer if checkpointing else layers * per_layer
    params = sum(p.numel() for p in lm.parameters())
    room = 0.5 * torch.cuda.get_device_properties(device).total_memory - 16 * params / world - 2 * GIB
    return int(min(max(room / per_token, 1024), 1 << 20))
