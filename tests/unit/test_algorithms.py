"""The algorithms' pieces against hand-computed cases: GAE (both λ), length-adaptive λ, the value
loss, the KL estimators, Dr. GRPO's normaliser, presets, and clip-higher acting once a step makes
several updates."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader
from rlbus.examples.addition import build_model
from trainer.config import TrainerConfig
from trainer.batch import collate
from trainer.loss import kl_estimate, policy_loss, positive_lm_loss, sequence_logprobs
from trainer.model import load_policy
from trainer.step import train_step
from trainer.value import (
    Critic,
    adaptive_lambda,
    explained_variance,
    gae,
    load_value_model,
    outcome_rewards,
    save_value_model,
    value_loss,
    whiten,
)


def test_gae_by_hand_for_both_lambdas() -> None:
    # One completion of 3 tokens, reward 1 on the last; values V0..V2; γ = 1.
    values = torch.tensor([[0.5, 0.2, 0.7]])
    mask = torch.ones(1, 3)
    rewards = outcome_rewards(torch.tensor([1.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 1.0]]
    # λ = 1 (λ_critic): A_t = R − V_t, so the value targets A + V are the return R at every token.
    critic = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(critic, torch.tensor([[0.5, 0.8, 0.3]]))
    assert torch.allclose(critic + values, torch.ones(1, 3))
    # λ = 0: one-step TD errors δ_t = r_t + V_{t+1} − V_t.
    assert torch.allclose(gae(rewards, values, mask, gamma=1.0, lam=0.0), torch.tensor([[-0.3, 0.5, 0.3]]))
    # γ = 0.9, λ = 0.5: δ = (0.9·0.2 − 0.5, 0.9·0.7 − 0.2, 1 − 0.7); A2 = 0.3, A1 = 0.43 + 0.45·0.3,
    # A0 = −0.32 + 0.45·A1.
    a1 = 0.43 + 0.45 * 0.3
    expected = torch.tensor([[-0.32 + 0.45 * a1, a1, 0.3]])
    assert torch.allclose(gae(rewards, values, mask, gamma=0.9, lam=0.5), expected, atol=1e-6)


def test_gae_passes_over_padding_and_masked_tokens_per_sample_lambda() -> None:
    # Row 0: tokens at columns 1, 2, 4 (column 3 is not trained on, e.g. a tool's output), reward 2.
    # Row 1: one token at column 0, reward −1. Row 2: no completion token.
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.float32)
    values = torch.tensor([[9.0, 0.1, 0.4, 9.0, 0.6], [0.3, 9.0, 9.0, 9.0, 9.0], [9.0] * 5])
    rewards = outcome_rewards(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert rewards[0].tolist() == [0, 0, 0, 0, 2.0] and rewards[1].tolist() == [-1.0, 0, 0, 0, 0]
    assert not rewards[2].any()
    adv = gae(rewards, values, mask, gamma=1.0, lam=torch.tensor([0.0, 1.0, 1.0]))
    # Row 0 with λ = 0: δ over the live tokens 0.1 → 0.4 → 0.6 → end.
    assert torch.allclose(adv[0], torch.tensor([0.0, 0.3, 0.2, 0.0, 1.4]))
    assert torch.allclose(adv[1], torch.tensor([-1.3, 0, 0, 0, 0]))
    assert not adv[2].any()


def test_length_adaptive_lambda() -> None:
    lam = adaptive_lambda(torch.tensor([100, 1000, 20, 3, 0]), alpha=0.05)
    # 1 − 1/(0.05·l): 0.8 at 100 tokens, 0.98 at 1,000; 0 at 1/α = 20 tokens and below (clamped).
    assert torch.allclose(lam, torch.tensor([0.8, 0.98, 0.0, 0.0, 0.0]))


def test_value_loss_explained_variance_and_whitening() -> None:
    values = torch.tensor([[0.0, 1.0, 5.0]])
    returns = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert float(value_loss(values, returns, mask)) == pytest.approx(0.25)  # ½·(1 + 0)/2
    old = torch.tensor([[0.5, 1.0, 5.0]])
    # clipped to within 0.2 of 0.5: 0.3, error 0.49 > 1.0? no: max(1.0, 0.49) = 1.0 at token 0.
    assert float(value_loss(values, returns, mask, old_values=old, clip=0.2)) == pytest.approx(0.25)
    far = torch.tensor([[2.0, 1.0, 5.0]])  # value 0 moved 2.0 from 2.0 … clipped at 1.8: error 0.64 < 1
    assert float(value_loss(values, returns, mask, old_values=far, clip=0.2)) == pytest.approx(0.25)
    wrong_way = torch.tensor([[-1.0, 1.0, 5.0]])  # clipped value −0.8: error 3.24 > 1
    assert float(value_loss(values, returns, mask, old_values=wrong_way, clip=0.2)) == pytest.approx(0.5 * 3.24 / 2)
    r = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    m = torch.ones(1, 4)
    assert explained_variance(r, r, m) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(r, 0.5), r, m) == pytest.approx(0.0)
    assert np.isnan(explained_variance(r, torch.ones_like(r), m))
    w = whiten(torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    assert torch.allclose(w, torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))


def test_kl_estimators_are_unbiased_and_k3_is_never_negative() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g)
    p = torch.softmax(logits, 0)
    q = torch.softmax(logits + 0.3 * torch.randn(50, generator=g), 0)  # a policy near its reference
    exact = float((p * (p.log() - q.log())).sum())
    draws = torch.multinomial(p, 200_000, replacement=True, generator=g)
    k1 = kl_estimate(p.log()[draws], q.log()[draws], "k1")
    k3 = kl_estimate(p.log()[draws], q.log()[draws], "k3")
    assert float(k1.mean()) == pytest.approx(exact, rel=0.03)
    assert float(k3.mean()) == pytest.approx(exact, rel=0.03)
    assert bool((k3 >= 0).all()) and bool((k1 < 0).any())
    assert float(k3.var()) < float(k1.var())  # near the reference, k3's variance is the lower
    # Equal policies: no penalty, no gradient.
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    kl_estimate(lp, lp.detach(), "k3").sum().backward()
    assert lp.grad.abs().max() == 0


def test_dr_grpo_normaliser_and_kl_term_in_the_loss() -> None:
    logp = torch.zeros(2, 4, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, 1.0])
    # Ratio 1: every token's loss is −A = −1. Token-level: −6/6; per sequence: mean(−1, −1);
    # Dr. GRPO: each sequence's sum over the constant 8, averaged: (−2/8 − 4/8)/2.
    for agg, expected in (("token", -1.0), ("sequence", -1.0), ("constant", -6 / 16)):
        loss, _ = policy_loss(logp, logp.detach(), adv, mask, agg=agg, norm_tokens=8)
        assert float(loss.detach()) == pytest.approx(expected), agg
    with pytest.raises(ValueError, match="norm_tokens"):
        policy_loss(logp, logp.detach(), adv, mask, agg="constant")
    ref = torch.full((2, 4), -0.5)
    kl = kl_estimate(logp, ref, "k1")  # 0.5 per token
    loss, stats = policy_loss(logp, logp.detach(), adv, mask, kl=kl, kl_coef=0.1)
    assert float(loss.detach()) == pytest.approx(-1.0 + 0.05) and stats["kl_ref"] == pytest.approx(0.5)
    lm = positive_lm_loss(torch.tensor([[-1.0, -3.0], [-5.0, -5.0]]), torch.ones(2, 2), torch.tensor([True, False]))
    assert float(lm) == pytest.approx(2.0)


def test_presets_set_the_papers_defaults_and_fields_override_them() -> None:
    grpo = TrainerConfig(algorithm="grpo")
    assert (grpo.loss_agg, grpo.clip_high, grpo.kl_coef, grpo.kl_estimator) == ("sequence", 0.2, 0.04, "k3")
    dr = TrainerConfig(algorithm="dr_grpo", clip_high=0.3)
    assert (dr.advantage_scale, dr.loss_agg, dr.clip_high, dr.kl_coef) == ("none", "constant", 0.3, 0.0)
    vapo = TrainerConfig.model_validate({"algorithm": "vapo", "value": {"pretrain_steps": 5}})
    assert vapo.advantage_estimator == "gae" and vapo.value.pretrain_steps == 5 and vapo.value.lambda_alpha == 0.05
    assert vapo.lm_loss_coef == 0.1 and vapo.clip_high == 0.28
    # Only the fields given count as set: a policy's trainer naming another algorithm gets its preset.
    assert dr.model_fields_set == {"algorithm", "clip_high"}
    assert TrainerConfig().algorithm is None and TrainerConfig().advantage_estimator == "group"
    # Value settings given without VAPO stay inert until an algorithm with a value model is chosen.
    inert = TrainerConfig.model_validate({"value": {"lr": 1e-3}})
    assert inert.advantage_estimator == "group" and inert.value.lr == 1e-3
    assert TrainerConfig.model_validate({"value": {"lr": 1e-3}, "algorithm": "vapo"}).value.lr == 1e-3
    with pytest.raises(ValueError):
        TrainerConfig(algorithm="ppo")


def _groups(vocab: int, rewards: list[list[float]]) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(1)
    out = []
    for g, group_rewards in enumerate(rewards):
        lengths = [3, 2, 4, 3][: len(group_rewards)]
        tokens = rng.integers(4, vocab, size=sum(lengths)).astype(np.int32)
        header = TrajectoryHeader(
            run="r", policy="main", group_id=f"g{g}", prompt_id=f"p{g}", task="t", worker_id="w",
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4), rewards=group_rewards,
            finish_reasons=["stop"] * len(lengths), min_version=0, max_version=0, vocab_size=vocab,
            created_at=time.time())
        out.append(TrajectoryGroup(
            header=header, prompt_tokens=rng.integers(4, vocab, size=3).astype(np.int32), completion_tokens=tokens,
            completion_offsets=np.cumsum([0, *lengths]).astype(np.int32),
            behaviour_logprobs=np.full(len(tokens), -3.0, np.float32), token_versions=np.zeros(len(tokens), np.int32)))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("m") / "m", hidden_size=32, layers=2, heads=2, intermediate_size=64)


def _after_step(model_dir: Path, config: TrainerConfig, lr: float = 2.0, **kwargs) -> tuple[dict[str, torch.Tensor], dict]:
    torch.manual_seed(0)
    model, tok = load_policy(model_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    groups = _groups(len(tok), [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
    result = train_step(model, optimizer, groups, config, pad_id=tok.pad_token_id, temperature=1.0, **kwargs)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, result.stats


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_clip_higher_acts_only_with_several_updates_per_step(model_dir: Path) -> None:
    base = dict(shared_prefix=False, importance_cap=None, grad_clip=100.0)
    # One update: π_prox is the training forward itself, the ratio is 1, ε_high changes nothing.
    one_a, stats = _after_step(model_dir, TrainerConfig(**base, clip_high=0.28))
    one_b, _ = _after_step(model_dir, TrainerConfig(**base, clip_high=5.0))
    assert _same(one_a, one_b) and stats["clip_fraction"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)
    # Four epochs: the ratio leaves the trust region after the first update, and ε_high decides.
    four_a, stats_a = _after_step(model_dir, TrainerConfig(**base, clip_high=0.28, ppo_epochs=4))
    four_b, stats_b = _after_step(model_dir, TrainerConfig(**base, clip_high=5.0, ppo_epochs=4))
    assert stats_a["clip_high_fraction"] > 0 and stats_b["clip_high_fraction"] < stats_a["clip_high_fraction"]
    assert not _same(four_a, four_b)
    # Two minibatches of one epoch act the same way: the second runs on updated weights.
    two_a, _ = _after_step(model_dir, TrainerConfig(**base, clip_high=0.01, clip_low=0.01, minibatches_per_step=2))
    two_b, _ = _after_step(model_dir, TrainerConfig(**base, clip_high=5.0, clip_low=5.0 - 4.01, minibatches_per_step=2))
    assert not _same(two_a, two_b)


def test_kl_to_a_reference_pulls_toward_it(model_dir: Path) -> None:
    reference, tok = load_policy(model_dir)
    reference.requires_grad_(False)
    batch = collate(_groups(len(tok), [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]]), tok.pad_token_id)
    ref_lp = sequence_logprobs(reference, batch.input_ids, batch.attention_mask)

    def kl_after(coef: float) -> float:
        weights, _ = _after_step(model_dir, TrainerConfig(shared_prefix=False, kl_coef=coef, ppo_epochs=8), lr=0.5,
                                 reference=reference)
        model, _ = load_policy(model_dir)
        model.load_state_dict(weights)
        with torch.no_grad():
            lp = sequence_logprobs(model, batch.input_ids, batch.attention_mask)
        k3 = kl_estimate(lp, ref_lp, "k3")
        return float((k3 * batch.completion_mask).sum() / batch.completion_mask.sum())

    free, held = kl_after(0.0), kl_after(2.0)
    assert held < 0.5 * free, (held, free)


def test_value_model_learns_the_returns_and_pretraining_keeps_the_policy(model_dir: Path, tmp_path: Path) -> None:
    config = TrainerConfig.model_validate({"algorithm": "vapo", "shared_prefix": False,
                                           "value": {"lr": 1e-2, "pretrain_steps": 1}})
    policy, tok = load_policy(model_dir)
    critic = Critic.build(config, model_dir, "cpu")
    # The transformer is the policy's own (loaded without its LM head), the head starts at zero.
    assert torch.equal(critic.model.base.get_input_embeddings().weight, policy.get_input_embeddings().weight)
    groups = _groups(len(tok), [[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    first = train_step(policy, optimizer, groups, config, pad_id=tok.pad_token_id, temperature=1.0, critic=critic,
                       policy_frozen=True)
    assert _same(start, policy.state_dict()) and first.stats["policy_frozen"] == 1.0
    losses = [first.stats["value_loss"]]
    for _ in range(30):
        losses.append(train_step(policy, optimizer, groups, config, pad_id=tok.pad_token_id, temperature=1.0,
                                 critic=critic, policy_frozen=True).stats["value_loss"])
    assert losses[-1] < 0.2 * losses[0]
    after = train_step(policy, optimizer, groups, config, pad_id=tok.pad_token_id, temperature=1.0, critic=critic)
    assert after.stats["explained_variance"] > 0.5 and "lm_loss" in after.stats
    assert not _same(start, policy.state_dict())  # all-equal groups train too: the value is the baseline
    assert after.samples == 12
    save_value_model(critic.model, tmp_path / "value")
    again = load_value_model(tmp_path / "value")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(again(ids, torch.ones_like(ids)), critic.model(ids, torch.ones_like(ids)))
