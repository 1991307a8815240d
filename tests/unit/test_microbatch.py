"""Micro-batches: an update split by a token budget accumulates exactly the whole batch's gradient, for
every loss aggregation, the KL and LM terms, M2PO's mask and the value model; packing keeps to its
budget, keeps samples in order, and deals equal numbers of passes to every rank."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader
from rlbus.examples.addition import build_model
from trainer.batch import collate
from trainer.config import TrainerConfig
from trainer.microbatch import cost, pack, plan
from trainer.model import load_policy
from trainer.step import train_step
from trainer.value import Critic

WHOLE = 1 << 20  # a budget no update reaches: one pass per update, as before micro-batches


def _groups(vocab: int, n: int = 5, seed: int = 0) -> list[TrajectoryGroup]:
    """Groups of ragged prompts and completions (some samples longer than a small budget), rewards
    that differ within every group, stale behaviour log-probs."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n):
        size = int(rng.integers(2, 5))
        lengths = [int(x) for x in rng.integers(1, 9, size=size)]
        tokens = rng.integers(4, vocab, size=sum(lengths)).astype(np.int32)
        rewards = [float(r) for r in rng.permutation(size) / size]
        header = TrajectoryHeader(
            run="r", policy="main", group_id=f"g{g}", prompt_id=f"p{g}", task="t", worker_id="w",
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8), rewards=rewards,
            finish_reasons=["stop"] * size, min_version=0, max_version=0, vocab_size=vocab, created_at=time.time())
        out.append(TrajectoryGroup(
            header=header, prompt_tokens=rng.integers(4, vocab, size=int(rng.integers(2, 7))).astype(np.int32),
            completion_tokens=tokens, completion_offsets=np.cumsum([0, *lengths]).astype(np.int32),
            behaviour_logprobs=rng.uniform(-4, -1, size=len(tokens)).astype(np.float32),
            token_versions=np.zeros(len(tokens), np.int32)))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("mb") / "m", hidden_size=32, layers=2, heads=2, intermediate_size=64)


def _update(model_dir: Path, config: TrainerConfig, **kwargs) -> tuple[dict[str, torch.Tensor], dict, float]:
    """Weights after one step with SGD (the update is −lr × the accumulated gradient), the stats, the loss."""
    torch.manual_seed(0)
    model, tok = load_policy(model_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    if "critic" in kwargs:
        kwargs["critic"] = Critic.build(config, model_dir, "cpu")
        kwargs["critic"].optimizer = torch.optim.SGD(kwargs["critic"].model.parameters(), lr=1.0)
    if "reference" in kwargs:
        kwargs["reference"], _ = load_policy(model_dir)
        with torch.no_grad():  # a reference the policy differs from
            for p in kwargs["reference"].parameters():
                p.add_(0.05 * torch.randn_like(p))
    result = train_step(model, optimizer, _groups(len(tok)), config, pad_id=tok.pad_token_id, temperature=0.9, **kwargs)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if "critic" in kwargs:
        weights.update({f"value.{k}": v.detach().clone() for k, v in kwargs["critic"].model.state_dict().items()})
    return weights, result.stats, result.loss


CASES = {
    "token mean (DAPO)": {},
    "sequence mean (GRPO)": {"loss_agg": "sequence"},
    "Dr. GRPO's constant": {"loss_agg": "constant", "loss_norm_tokens": 8},
    "KL to a reference and the positive-example LM loss": {"kl_coef": 0.3, "lm_loss_coef": 0.5},
    "M2PO's mask over the whole update": {"m2po_threshold": 0.5},
    "several updates per step": {"ppo_epochs": 2, "minibatches_per_step": 2},
    "plain forward": {"shared_prefix": False},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("budget", [12, 40])
def test_micro_batches_accumulate_the_whole_batch_update(model_dir: Path, case: str, budget: int) -> None:
    settings = {"grad_clip": 1e6, "importance_cap": None, **CASES[case]}
    extra = {"reference": None} if settings.get("kl_coef") else {}
    whole, whole_stats, whole_loss = _update(model_dir, TrainerConfig(micro_batch_tokens=WHOLE, **settings), **extra)
    split, split_stats, split_loss = _update(model_dir, TrainerConfig(micro_batch_tokens=budget, **settings), **extra)
    start, _ = load_policy(model_dir)
    moved = max(float((whole[k] - v).abs().max()) for k, v in start.state_dict().items())
    assert moved > 1e-4, "the step must change the weights for the comparison to mean anything"
    for name, value in whole.items():
        torch.testing.assert_close(split[name], value, atol=1e-5, rtol=1e-4, msg=name)
    assert split_loss == pytest.approx(whole_loss, rel=1e-4, abs=1e-6)
    for key in ("clip_fraction", "ratio_mean", "importance_weight_mean", "importance_weight_max", "entropy",
                "kl_ref", "lm_loss", "m2po_masked_tokens"):
        if key in whole_stats:
            assert split_stats[key] == pytest.approx(whole_stats[key], rel=1e-4, abs=1e-6), key


def test_the_value_model_accumulates_the_whole_batch_update_too(model_dir: Path) -> None:
    settings = {"algorithm": "vapo", "grad_clip": 1e6, "importance_cap": None,
                "value": {"grad_clip": 1e6, "clip": 0.2, "pretrain_steps": 0}}
    whole, whole_stats, _ = _update(model_dir, TrainerConfig.model_validate({**settings, "micro_batch_tokens": WHOLE}),
                                    critic=None)
    split, split_stats, _ = _update(model_dir, TrainerConfig.model_validate({**settings, "micro_batch_tokens": 12}),
                                    critic=None)
    assert any(k.startswith("value.") for k in whole)
    for name, value in whole.items():
        torch.testing.assert_close(split[name], value, atol=1e-5, rtol=1e-4, msg=name)
    for key in ("value_loss", "value_mean", "explained_variance"):
        assert split_stats[key] == pytest.approx(whole_stats[key], rel=1e-4, abs=1e-6), key


def test_packing_keeps_order_and_budget_and_counts_a_shared_prompt_once() -> None:
    groups = _groups(100, n=6, seed=3)
    batch = collate(groups, pad_id=0)
    lengths = batch.attention_mask.sum(1).tolist()
    prompts = batch.prompt_lengths.tolist()
    index = batch.group_index.tolist()
    rows = list(range(batch.num_samples))
    for shared in (False, True):
        for budget in (1, 10, 25, 60):
            parts = pack(batch, rows, budget, shared_prefix=shared)
            assert [r for part in parts for r in part] == rows  # every sample once, in order
            for part in parts:
                spent = cost([prompts[r] for r in part], [lengths[r] for r in part], [index[r] for r in part], shared)
                assert spent <= budget or len(part) == 1  # only a sample longer than the budget goes over
    # A group of 3 samples with a 6-token prompt and completions of 2: 18 tokens each plain, 6 + 3·2 shared.
    assert cost([6, 6, 6], [8, 8, 8], [0, 0, 0], False) == 24
    assert cost([6, 6, 6], [8, 8, 8], [0, 0, 0], True) == 12


def test_every_rank_runs_as_many_passes_and_all_rows_are_dealt_once() -> None:
    batch = collate(_groups(100, n=7, seed=5), pad_id=0)
    for world in (2, 3, 8):
        plans = [plan(batch, 20, shared_prefix=True, world=world, rank=r) for r in range(world)]
        assert len({len(p) for p in plans}) == 1
        live = [int(row) for p in plans for mb in p if mb.live for row in mb.rows]
        assert sorted(live) == list(range(batch.num_samples))
        tokens = [sum(int(batch.attention_mask[mb.rows].sum()) for mb in p if mb.live) for p in plans]
        if world == 2:  # contiguous halves of about equal tokens
            assert abs(tokens[0] - tokens[1]) <= max(batch.attention_mask.sum(1).tolist())


def test_the_shared_prefix_runs_only_where_it_saves_tokens(model_dir: Path) -> None:
    """Groups of four samples: the prompt pass and the completion pass (two embedding calls a
    micro-batch); groups of one sample gain nothing from a shared prompt: one plain pass."""
    model, tok = load_policy(model_dir)
    calls: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    reference = load_policy(model_dir)[0]
    reference.get_input_embeddings().register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0]))
    groups = _groups(len(tok), n=3)
    samples = sum(g.group_size for g in groups)
    config = TrainerConfig(micro_batch_tokens=WHOLE, kl_coef=0.1)  # keeps every sample (and makes a reference pass)
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), groups, config, pad_id=tok.pad_token_id,
               temperature=1.0, reference=reference)
    assert calls == [3, samples, 3, samples]
    singles = []
    for g in groups:  # each sample alone in a group of its own
        for s in range(g.group_size):
            start, end = int(g.completion_offsets[s]), int(g.completion_offsets[s + 1])
            header = g.header.model_copy(update={"group_id": f"{g.header.group_id}-{s}", "rewards": [float(s % 2)],
                                                 "finish_reasons": ["stop"]})
            singles.append(TrajectoryGroup(
                header=header, prompt_tokens=g.prompt_tokens, completion_tokens=g.completion_tokens[start:end],
                completion_offsets=np.array([0, end - start], np.int32),
                behaviour_logprobs=g.behaviour_logprobs[start:end], token_versions=g.token_versions[start:end]))
    calls.clear()
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), singles, config, pad_id=tok.pad_token_id,
               temperature=1.0, reference=reference)
    assert calls == [samples, samples]  # the reference's plain pass and the policy's


def test_a_micro_batch_without_trained_tokens_leaves_the_maxima_alone() -> None:
    """A rank's stand-in reports importance_weight_max 1.0 for no token: it must not raise the
    step's maximum over the tokens trained (0.7), nor change a mean; a step of stand-ins alone
    keeps their value."""
    from trainer.ranks import OneRank
    from trainer.step import _Sums

    sums = _Sums()
    sums.add({"importance_weight_max": 0.7, "ratio_mean": 1.2}, 10.0, {"loss": 0.5})
    sums.add({"importance_weight_max": 1.0, "ratio_mean": 1.0}, 0.0, {"loss": 0.0})
    out = sums.result(OneRank(), 10.0)
    assert out == {"loss": 0.5, "importance_weight_max": 0.7, "ratio_mean": pytest.approx(1.2)}
    alone = _Sums()
    alone.add({"importance_weight_max": 1.0}, 0.0, {"loss": 0.0})
    assert alone.result(OneRank(), 0.0)["importance_weight_max"] == 1.0
