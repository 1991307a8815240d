"""Expert-load balancing from recorded routing (ReLibra's idea): every row in one micro-batch, within
the budget, each group's rows together, every rank as many passes and no more than in arrival order,
the experts' load more even than in arrival order; without routing, the plan of arrival order."""

from __future__ import annotations

import pytest
import torch

from trainer.batch import TrainBatch
from trainer.config import TrainerConfig
from trainer.microbatch import expert_imbalance, pack, plan, split_for_ranks, tokens


def _batch(prompts: list[int], completions: list[int], groups: list[int], routing: torch.Tensor | None) -> TrainBatch:
    """Samples of the given prompt and completion lengths and groups; ``routing`` [N, L, layers, top_k] or None."""
    n, lengths = len(prompts), [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(lengths)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    zeros = torch.zeros(n, width - 1)
    if routing is not None:
        routing = torch.where(mask.bool()[:, :, None, None], routing, -1)
    return TrainBatch(input_ids=torch.zeros(n, width, dtype=torch.long), attention_mask=mask,
                      completion_mask=zeros.clone(), behaviour_logprobs=zeros.clone(), token_versions=zeros.long() - 1,
                      rewards=torch.zeros(n), group_index=torch.tensor(groups), prompt_lengths=torch.tensor(prompts),
                      step_node=zeros.long() - 1, step_bonus=zeros.clone(), routing=routing)


def _kinds(kinds: list[int], size: int = 4) -> TrainBatch:
    """Groups of ``size`` samples of 10 tokens (a 4-token prompt) whose every position goes to the expert
    ``kinds[g]`` of group g (one MoE layer, top-1, two experts)."""
    groups = [g for g in range(len(kinds)) for _ in range(size)]
    routing = torch.tensor([kinds[g] for g in groups])[:, None, None, None].expand(len(groups), 10, 1, 1)
    return _batch([4] * len(groups), [6] * len(groups), groups, routing.clone())


def _realistic(seed: int, groups: int = 12, experts: int = 16, layers: int = 2, top_k: int = 2) -> TrainBatch:
    """Groups of 2–6 samples of ragged lengths; experts skewed in popularity, and the samples of one
    prompt sharing a preference of their own (and the prompt's routing)."""
    gen = torch.Generator().manual_seed(seed)
    popular = torch.randn(layers, experts, generator=gen)
    prompts, completions, index, rows = [], [], [], []
    for g in range(groups):
        size, prompt = int(torch.randint(2, 7, (), generator=gen)), int(torch.randint(2, 12, (), generator=gen))
        prefer = popular + 3 * torch.randn(layers, experts, generator=gen)
        pick = lambda count: (prefer - torch.log(-torch.log(torch.rand(count, layers, experts, generator=gen)))  # noqa: E731
                              ).topk(top_k, -1).indices
        shared = pick(prompt)
        for _ in range(size):
            completion = int(torch.randint(1, 30, (), generator=gen))
            prompts.append(prompt), completions.append(completion), index.append(g)
            rows.append(torch.cat([shared, pick(completion)]))
    width = max(p + c for p, c in zip(prompts, completions))
    routing = torch.stack([torch.cat([r, r.new_full((width - len(r), layers, top_k), -1)]) for r in rows])
    return _batch(prompts, completions, index, routing)


def _plans(batch: TrainBatch, budget: int, shared_prefix: bool, world: int, balance: bool = True):
    return [plan(batch, budget, shared_prefix=shared_prefix, world=world, rank=r, balance_experts=balance)
            for r in range(world)]


def _rows(plans) -> list[list[tuple[list[int], bool]]]:
    return [[(mb.rows.tolist(), mb.live) for mb in p] for p in plans]


@pytest.mark.parametrize("shared_prefix", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("budget", [20, 60, 150])
def test_every_row_once_within_the_budget_with_its_group_and_no_more_passes(shared_prefix: bool, world: int,
                                                                           budget: int) -> None:
    batch = _realistic(seed=budget + world)
    plans = _plans(batch, budget, shared_prefix, world)
    assert _rows(plans) == _rows(_plans(batch, budget, shared_prefix, world))  # the same on every call (and rank)
    live = [mb.rows.tolist() for p in plans for mb in p if mb.live]
    assert sorted(r for rows in live for r in rows) == list(range(batch.num_samples))
    for rows in live:
        assert tokens(batch, rows, shared_prefix=shared_prefix) <= budget or len(rows) == 1
        runs = torch.unique_consecutive(batch.group_index[rows]).numel()
        assert runs == batch.group_index[rows].unique().numel()  # each group's rows together
    arrival = _plans(batch, budget, shared_prefix, world, balance=False)
    assert len({len(p) for p in plans}) == 1
    assert len(plans[0]) <= len(arrival[0])


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_micro_batches_of_one_expert_each_are_mixed(shared_prefix: bool) -> None:
    """Four groups routed to expert 0, then four to expert 1: in arrival order every micro-batch loads
    one expert (max ÷ mean 2); balanced, both alike (1), in as many micro-batches."""
    batch = _kinds([0, 0, 0, 0, 1, 1, 1, 1])
    budget = 60 if shared_prefix else 80  # two groups a micro-batch: 2 × 4 + 8 × 6 shared, 8 × 10 plain
    before = expert_imbalance(batch, _plans(batch, budget, shared_prefix, 1, balance=False), shared_prefix=shared_prefix)
    after = expert_imbalance(batch, _plans(batch, budget, shared_prefix, 1), shared_prefix=shared_prefix)
    assert (before["mean"], before["worst"], before["micro_batches"]) == (2.0, 2.0, 4.0)
    assert (after["mean"], after["worst"], after["micro_batches"]) == (1.0, 1.0, 4.0)


def test_each_pass_across_ranks_is_mixed() -> None:
    """Two ranks each get, in arrival order, their half's expert-0 groups in the first pass and its
    expert-1 groups in the second: each pass sends all its tokens to one expert; balanced, every pass
    loads both alike, and each rank runs as many passes as before."""
    batch = _kinds([0, 0, 1, 1, 0, 0, 1, 1])
    before = expert_imbalance(batch, _plans(batch, 80, False, 2, balance=False), shared_prefix=False)
    plans = _plans(batch, 80, False, 2)
    after = expert_imbalance(batch, plans, shared_prefix=False)
    assert (before["pass_mean"], before["passes"]) == (2.0, 2.0)
    assert (after["pass_mean"], after["pass_worst"], after["passes"]) == (1.0, 1.0, 2.0)
    assert [len(p) for p in plans] == [2, 2]


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_skewed_routing_loads_the_busiest_experts_less(shared_prefix: bool) -> None:
    for seed in range(3):
        batch = _realistic(seed)
        before = expert_imbalance(batch, _plans(batch, 120, shared_prefix, 1, balance=False),
                                  shared_prefix=shared_prefix)
        after = expert_imbalance(batch, _plans(batch, 120, shared_prefix, 1), shared_prefix=shared_prefix)
        assert after["slowdown"] < before["slowdown"], seed
        assert after["micro_batches"] <= before["micro_batches"], seed


def test_without_routing_the_plan_is_arrival_order() -> None:
    batch = _realistic(seed=7)
    unrecorded = _batch(batch.prompt_lengths.tolist(), (batch.attention_mask.sum(1) - batch.prompt_lengths).tolist(),
                        batch.group_index.tolist(), torch.full_like(batch.routing, -1))
    dense = _batch(batch.prompt_lengths.tolist(), (batch.attention_mask.sum(1) - batch.prompt_lengths).tolist(),
                   batch.group_index.tolist(), None)
    for world in (1, 3):
        for shared_prefix in (True, False):
            parts = [pack(batch, part, 40, shared_prefix=shared_prefix)
                     for part in split_for_ranks(batch, list(range(batch.num_samples)), world)]
            expected = [[*(p), *([[0]] * (max(map(len, parts)) - len(p)))] for p in parts]
            for b, balance in ((dense, True), (unrecorded, True), (batch, False)):
                got = [[mb.rows.tolist() for mb in p] for p in _plans(b, 40, shared_prefix, world, balance)]
                assert got == expected


def test_the_measure_counts_recorded_positions_and_a_shared_prompt_once() -> None:
    """One group of two samples: a 2-token prompt routed to expert 0, completions of 3 tokens to
    expert 1 and of 1 token to expert 2, the second sample's last positions unrecorded (padding)."""
    routing = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 2, -1, -1]])[:, :, None, None]
    batch = _batch([2, 2], [3, 1], [0, 0], routing)
    whole = [[next(iter(plan(batch, 100, shared_prefix=True, balance_experts=False)))]]
    # Shared: loads (2, 3, 1): max 3 ÷ mean 2. Plain: (4, 3, 1): 4 ÷ 8/3.
    assert expert_imbalance(batch, whole, shared_prefix=True)["mean"] == pytest.approx(1.5)
    assert expert_imbalance(batch, whole, shared_prefix=False)["mean"] == pytest.approx(1.5)
    assert TrainerConfig().balance_experts and not TrainerConfig(balance_experts=False).balance_experts
