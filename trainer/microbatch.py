"""Micro-batches: an update's samples packed into forward/backward passes of at most a token budget,
dealt to the trainer's ranks; their gradients accumulate into one optimizer update.

A micro-batch's cost is the tokens its forward runs, padding included: rows × longest sequence for
the plain forward; for the shared-prefix forward, each group's prompt once (as long as the longest
prompt) plus rows × longest completion. Samples are taken in order (a group's samples stay
together, which the shared prefix needs); one longer than the budget is a micro-batch of its own.

A mixture-of-experts batch carries the experts each position is routed to (``TrainBatch.routing``),
known before the step trains; then the micro-batches are packed, and dealt to ranks, so that each
pass loads the experts evenly (ReLibra's idea: with expert parallelism a pass waits on its busiest
expert), within the same budget and in no more passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

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


def plan(batch: TrainBatch, budget: int, *, shared_prefix: bool, world: int = 1, rank: int = 0,
         balance_experts: bool = True) -> list[MicroBatch]:
    """This rank's micro-batches over every row of ``batch``: its part of the rows, packed by
    ``budget``, then stand-ins up to the largest count any rank has (every rank runs as many passes:
    each pass of a sharded model is a collective). With ``balance_experts`` and routing recorded in
    ``batch``, ``balanced``'s passes instead."""
    rows = list(range(batch.num_samples))
    packed = [pack(batch, part, budget, shared_prefix=shared_prefix) for part in split_for_ranks(batch, rows, world)]
    if balance_experts and batch.routing is not None and bool((batch.routing >= 0).any()):
        packed = balanced(batch, budget, shared_prefix=shared_prefix, world=world, arrival=packed)
    longest = max(len(p) for p in packed)
    stand_in = MicroBatch(torch.zeros(1, dtype=torch.long), live=False)
    mine = [MicroBatch(torch.tensor(r, dtype=torch.long)) if r else stand_in for r in packed[rank]]
    return mine + [stand_in] * (longest - len(mine))


def expert_loads(batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the tokens routed to each expert of each MoE layer, of its prompt and of the rest of
    its sequence: two long [N, layers, E] (E: the highest expert recorded + 1; recorded positions only)."""
    routing = batch.routing
    n, length, layers, _ = routing.shape
    experts = int(routing.max()) + 1
    rest = (torch.arange(length)[None, :, None] >= batch.prompt_lengths[:, None, None]).long()
    out = torch.zeros(n, layers, 2 * (experts + 1), dtype=torch.long)
    for layer in range(layers):  # a layer at a time: [N, L, top_k] indices, not [N, L, layers, top_k]
        chosen = routing[:, :, layer]
        index = torch.where(chosen >= 0, chosen, experts) + rest * (experts + 1)  # unrecorded: column E, dropped
        out[:, layer].scatter_add_(1, index.flatten(1), torch.ones_like(index).flatten(1))
    return out[..., :experts].contiguous(), out[..., experts + 1 : -1].contiguous()


@dataclass
class _Forward:
    """A micro-batch being filled: its rows, shape, groups, and once filled its expert loads [layers, E]."""

    rows: list[int] = field(default_factory=list)
    shape: _Shape = _Shape()
    groups: set[int] = field(default_factory=set)
    load: torch.Tensor | None = None


class _Rows:
    """What balancing looks up per row of a batch, and the time it models a plan by."""

    def __init__(self, batch: TrainBatch, shared_prefix: bool) -> None:
        self.prompt, self.rest = expert_loads(batch)
        self.lengths, self.prompts = batch.attention_mask.sum(1).tolist(), batch.prompt_lengths.tolist()
        self.groups = batch.group_index.tolist()
        self.shared_prefix = shared_prefix
        _, _, layers, top_k = batch.routing.shape
        self.scale = self.prompt.shape[-1] / top_k / layers  # Σ over layers of a max load → tokens at an even load

    def cost(self, rows: list[int]) -> int:
        return cost([self.prompts[r] for r in rows], [self.lengths[r] for r in rows], [self.groups[r] for r in rows],
                    self.shared_prefix)

    def grown(self, into: _Forward, row: int) -> _Shape:
        return into.shape.grown(self.lengths[row], self.prompts[row], self.groups[row] not in into.groups)

    def load(self, rows: list[int]) -> torch.Tensor:
        """[layers, E] tokens a forward over ``rows`` routes to each expert (a group's prompt once with the
        shared prefix)."""
        seen, prompts = set(), []
        for row in rows:
            if not self.shared_prefix or self.groups[row] not in seen:
                prompts.append(row)
            seen.add(self.groups[row])
        return self.rest[torch.tensor(rows)].sum(0) + self.prompt[torch.tensor(prompts)].sum(0)

    def time(self, passes: list[list[list[int]]]) -> float:
        """The time ``passes`` (each rank's rows of each pass) take in tokens: per pass, the most any rank's
        forward runs (``cost``) plus its ranks' summed load of the busiest experts at an even load
        (``scale`` ÷ world: a token of attention and a token of experts count alike)."""
        total = 0.0
        for k in range(max(len(p) for p in passes)):
            forwards = [p[k] for p in passes if k < len(p) and p[k]]
            busiest = sum((self.load(f) for f in forwards), torch.zeros_like(self.prompt[0])).amax(-1).sum()
            total += max(map(self.cost, forwards), default=0) + float(busiest) * self.scale / len(passes)
        return total


def _spread(loads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Of expert loads [..., layers, E]: max and mean over the experts, of each layer that routes a token."""
    peak, mean = loads.amax(-1).flatten().double(), loads.double().mean(-1).flatten()
    return peak[mean > 0], mean[mean > 0]


def expert_imbalance(batch: TrainBatch, plans: list[list[MicroBatch]], *, shared_prefix: bool) -> dict[str, float]:
    """How unevenly ``plans`` (each rank's ``plan``) load the experts recorded in ``batch.routing``.

    A forward's load of expert e in an MoE layer is the tokens it routes there (recorded positions only;
    with ``shared_prefix`` each group's prompt once, as that forward runs it), and its imbalance in the
    layer max ÷ mean of the load over all E experts (1: even). ``mean``, ``worst``: over the live
    micro-batches and the layers they route tokens through; ``slowdown``: Σ max ÷ Σ mean over the same,
    the time the experts take against an even load. With several ranks also ``pass_mean``, ``pass_worst``,
    ``pass_slowdown``: the same of each pass, all ranks' k-th micro-batches summed (what one
    expert-parallel pass sends each expert), and ``rank_mean``, ``rank_worst``: of each rank's loads
    summed over its passes. And ``micro_batches`` (live) and ``passes`` (of each rank)."""
    rows = _Rows(batch, shared_prefix)
    loads = torch.stack([torch.stack([rows.load(mb.rows.tolist()) if mb.live else torch.zeros_like(rows.prompt[0])
                                      for mb in p]) for p in plans])  # [ranks, passes, layers, E]
    live = torch.tensor([[mb.live for mb in p] for p in plans])
    out = {"micro_batches": float(live.sum()), "passes": float(len(plans[0]))}
    views = {"": loads[live]} | ({"pass_": loads.sum(0), "rank_": loads.sum(1)} if len(plans) > 1 else {})
    for name, view in views.items():
        peak, mean = _spread(view)
        out |= {f"{name}mean": float((peak / mean).mean()), f"{name}worst": float((peak / mean).max())}
        if name != "rank_":
            out[f"{name}slowdown"] = float(peak.sum() / mean.sum())
    return out


def balanced(batch: TrainBatch, budget: int, *, shared_prefix: bool, world: int,
             arrival: list[list[list[int]]]) -> list[list[list[int]]]:
    """Each rank's passes (the rows of each; [] a stand-in) packed by ``budget`` for an even load of the
    experts of ``batch.routing``: of ``arrival`` (each rank's ``pack``) and the ``_fill``s of the samples
    largest first (and, with the shared prefix, of the groups largest first, each group's samples
    together), opening micro-batches only where a sample fits none or up to as many as ``arrival`` has,
    dealt by ``_deal``, the one of least ``_Rows.time`` among those with no more passes than ``arrival``.
    A micro-batch's rows are in group order (each group's rows together, as the shared prefix needs)."""
    rows = _Rows(batch, shared_prefix)
    alone = [rows.cost([r]) for r in range(batch.num_samples)]
    members: dict[int, list[int]] = {}
    for row, group in enumerate(rows.groups):
        members.setdefault(group, []).append(row)
    size = {g: rows.cost(m) for g, m in members.items()}
    orders = [sorted(range(batch.num_samples), key=lambda r: (-alone[r], r))]
    if shared_prefix:
        orders.append(sorted(range(batch.num_samples),
                             key=lambda r: (-size[rows.groups[r]], members[rows.groups[r]][0], -alone[r], r)))
    best, fastest = arrival, rows.time(arrival)
    for order in orders:
        for slots in (0, sum(map(len, arrival))):
            forwards = _fill(rows, order, budget, slots)
            for f in forwards:
                f.rows.sort(key=lambda r: (members[rows.groups[r]][0], r))
            forwards.sort(key=lambda f: f.rows[0])
            passes = [[f.rows for f in forwards]] if world == 1 else _deal(forwards, world, rows.lengths)
            if len(passes[0]) <= max(map(len, arrival)) and (time := rows.time(passes)) < fastest:
                best, fastest = passes, time
    return best


def _fill(rows: _Rows, order: list[int], budget: int, slots: int) -> list[_Forward]:
    """Micro-batches of ``order``'s rows, each placed in turn in the micro-batch that it fits and adds least time
    to (its ``cost`` plus its busiest experts' load at an even load: so a sample goes where its experts are idle,
    and stays with its group and with samples of its length unless that saves more), of those the one whose
    busiest experts it leaves least loaded, the first such; an empty one is a candidate while fewer than
    ``slots`` exist, or where the sample fits none."""
    forwards: list[_Forward] = []
    loads = torch.zeros(0, *rows.prompt.shape[1:], dtype=torch.long)  # of ``forwards``
    for row in order:
        shapes = [rows.grown(f, row) for f in forwards]
        fits = [i for i, s in enumerate(shapes) if s.cost(rows.shared_prefix) <= budget]
        if not fits or len(forwards) < slots:
            forwards.append(_Forward())
            loads = torch.cat([loads, torch.zeros_like(loads[:1] if len(loads) else rows.prompt[:1])])
            shapes.append(rows.grown(forwards[-1], row))
            fits.append(len(forwards) - 1)
        again = torch.tensor([not rows.shared_prefix or rows.groups[row] not in forwards[i].groups for i in fits])
        before = loads[torch.tensor(fits)]
        added = rows.rest[row] + rows.prompt[row] * again[:, None, None]
        after = before.add(added).amax(-1).sum(-1)
        spent = torch.tensor([shapes[i].cost(rows.shared_prefix) - forwards[i].shape.cost(rows.shared_prefix)
                              for i in fits])
        more = spent + rows.scale * (after - before.amax(-1).sum(-1)).double()
        pick = int(torch.where(more == more.min(), after, after.max() + 1).argmin())
        chosen = forwards[fits[pick]]
        loads[fits[pick]] += added[pick]
        chosen.rows.append(row)
        chosen.shape = shapes[fits[pick]]
        chosen.groups.add(rows.groups[row])
        if not forwards[-1].rows:  # opened for this row, which went elsewhere
            forwards.pop()
            loads = loads[:-1]
    for f, load in zip(forwards, loads):
        f.load = load
    return forwards


def _deal(forwards: list[_Forward], world: int, lengths: list[int]) -> list[list[list[int]]]:
    """``forwards`` as each of ``world`` ranks' passes (ceil(n ÷ world) of them): busiest first, each joins the
    pass of fewer than ``world`` whose summed load it leaves lowest; within a pass the larger go to the
    ranks with fewer tokens so far."""
    count = -(-len(forwards) // world)
    passes: list[list[_Forward]] = [[] for _ in range(count)]
    sums = torch.zeros(count, *forwards[0].load.shape, dtype=torch.long)
    for f in sorted(forwards, key=lambda f: (-int(f.load.amax(-1).sum()), f.rows[0])):
        room = [k for k in range(count) if len(passes[k]) < world]
        k = room[int((sums[room] + f.load).amax(-1).sum(-1).argmin())]
        passes[k].append(f)
        sums[k] += f.load
    dealt: list[list[list[int]]] = [[] for _ in range(world)]
    spent = [0] * world
    for members in passes:
        ranks = sorted(range(world), key=lambda r: (spent[r], r))
        members = sorted(members, key=lambda f: (-sum(lengths[r] for r in f.rows), f.rows[0]))
        for r, rank in enumerate(ranks):
            rows = members[r].rows if r < len(members) else []
            dealt[rank].append(rows)
            spent[rank] += sum(lengths[q] for q in rows)
    return dealt


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
