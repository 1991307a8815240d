"""Policy loss on hand-computed numbers, clipping on both sides, the decoupled weight, advantages."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader
from trainer.batch import advantages, collate
from trainer.loss import policy_loss

# Two sequences of three tokens; old (proximal) log-probs are 0 so the ratio is exp(logprobs).
# Clip range with clip_low=0.2, clip_high=0.28 is [0.8, 1.28].
#   seq 0, A = +1, ratios 1.0, 1.5, 0.5:  min(r A, clip(r) A) = 1.0, 1.28 (clipped high), 0.5
#   seq 1, A = -2, ratios 1.0, 0.5, (masked):  min = -2.0, -1.6 (clipped low)
# per-token loss = -(1.0 + 1.28 + 0.5 - 2.0 - 1.6) summed = 0.82 over 5 tokens -> 0.164
RATIOS = torch.tensor([[1.0, 1.5, 0.5], [1.0, 0.5, 1.5]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -2.0])


def _loss(**kwargs):
    logprobs = RATIOS.log().clone().requires_grad_(True)
    loss, stats = policy_loss(logprobs, torch.zeros(2, 3), ADV, MASK, clip_low=0.2, clip_high=0.28, **kwargs)
    loss.backward()
    return loss, stats, logprobs.grad


def test_token_level_loss_matches_hand_computation():
    loss, stats, grad = _loss()
    assert loss.item() == pytest.approx(0.82 / 5)
    assert stats["tokens"] == 5
    assert stats["ratio_mean"] == pytest.approx((1.0 + 1.5 + 0.5 + 1.0 + 0.5) / 5)
    k3 = lambda r: (r - 1) - math.log(r)  # noqa: E731
    assert stats["approx_kl"] == pytest.approx((k3(1.5) + 2 * k3(0.5)) / 5)


def test_sequence_level_aggregation_averages_each_sequence_first():
    loss, _, _ = _loss(agg="sequence")
    seq0 = -(1.0 + 1.28 + 0.5) / 3
    seq1 = (2.0 + 1.6) / 2
    assert loss.item() == pytest.approx((seq0 + seq1) / 2)


def test_clipping_on_both_sides_stops_the_gradient():
    _, stats, grad = _loss()
    # d loss / d logprob = -A * r / N where the unclipped term is the minimum, 0 where clipped.
    expected = torch.tensor([[-1.0 * 1.0 / 5, 0.0, -1.0 * 0.5 / 5], [2.0 * 1.0 / 5, 0.0, 0.0]])
    torch.testing.assert_close(grad, expected)
    assert stats["clip_high_fraction"] == pytest.approx(1 / 5)
    assert stats["clip_low_fraction"] == pytest.approx(1 / 5)
    assert stats["clip_fraction"] == pytest.approx(2 / 5)


def test_ratio_below_range_with_positive_advantage_is_not_clipped():
    # r = 0.5 < 0.8 with A > 0: the pessimistic minimum is the unclipped 0.5, gradient flows.
    _, _, grad = _loss()
    assert grad[0, 2].item() == pytest.approx(-0.1)


def test_decoupled_weight_scales_loss_and_gradient_and_can_be_capped():
    base_loss, _, base_grad = _loss()
    behaviour = torch.full((2, 3), -math.log(2.0))  # pi_prox / pi_behav = 2 on every token
    loss, stats, grad = _loss(behaviour_logprobs=behaviour)
    assert loss.item() == pytest.approx(2 * base_loss.item())
    torch.testing.assert_close(grad, 2 * base_grad)
    assert stats["importance_weight_mean"] == pytest.approx(2.0)
    capped, stats, _ = _loss(behaviour_logprobs=behaviour, importance_cap=1.5)
    assert capped.item() == pytest.approx(1.5 * base_loss.item())
    assert stats["importance_weight_max"] == pytest.approx(1.5)


def test_masked_positions_never_produce_nan():
    logprobs = torch.tensor([[-1.0, float("-inf")]], requires_grad=True)
    loss, _ = policy_loss(logprobs, torch.tensor([[-1.0, 0.0]]), torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    none = advantages(rewards, groups, "none")
    torch.testing.assert_close(none, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.0, 0.0]))
    std = advantages(rewards, groups, "std")
    sample_std = math.sqrt((0.75**2 + 3 * 0.25**2) / 3)
    torch.testing.assert_close(std[:4], none[:4] / sample_std, atol=1e-5, rtol=1e-5)
    assert std[4:].abs().max() == 0  # all-equal group carries no signal


def test_subgroups_are_compared_within_themselves():
    """A group of 6 in subgroups [0, 0, 1, 1, 0, 2] and a plain group of 2: four sets of compared samples."""

    def group(gid, rewards, subgroups):
        n = len(rewards)
        header = TrajectoryHeader(
            run="r", policy="p", group_id=gid, prompt_id=gid, task="t", worker_id="w",
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=1), rewards=rewards,
            finish_reasons=["stop"] * n, min_version=0, max_version=0, vocab_size=50, created_at=0.0,
            subgroups=subgroups)
        return TrajectoryGroup(header=header, prompt_tokens=np.array([1, 2], np.int32),
                               completion_tokens=np.full(n, 3, np.int32), completion_offsets=np.arange(n + 1, dtype=np.int32),
                               behaviour_logprobs=np.zeros(n, np.float32), token_versions=np.zeros(n, np.int32))

    batch = collate([group("a", [1.0, 0.0, 1.0, 1.0, 1.0, 0.0], [0, 0, 1, 1, 0, 2]), group("b", [0.0, 1.0], None)], 0)
    assert batch.group_index.tolist() == [0, 0, 1, 1, 0, 2, 3, 3]
    adv = advantages(batch.rewards, batch.group_index, "none")
    # subgroup 0 holds rewards 1, 0, 1 (mean 2/3); subgroup 1 is all equal; 2 is alone; the plain group's mean is 1/2
    torch.testing.assert_close(adv, torch.tensor([1 / 3, -2 / 3, 0.0, 0.0, 1 / 3, 0.0, -0.5, 0.5]))


def test_collate_aligns_completion_columns_with_next_token_targets():
    header = TrajectoryHeader(
        run="r", policy="p", group_id="g", prompt_id="q", task="addition", worker_id="w",
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4), rewards=[1.0, 0.0],
        finish_reasons=["stop", "length"], min_version=3, max_version=4, vocab_size=50, created_at=0.0,
    )
    group = TrajectoryGroup(
        header=header,
        prompt_tokens=np.array([1, 5, 6], dtype=np.int32),
        completion_tokens=np.array([7, 2, 8, 9, 10], dtype=np.int32),
        completion_offsets=np.array([0, 2, 5], dtype=np.int32),
        behaviour_logprobs=np.array([-0.1, -0.2, -0.3, -0.4, -0.5], dtype=np.float32),
        token_versions=np.array([3, 3, 3, 4, 4], dtype=np.int32),
        loss_mask=np.array([1, 1, 1, 0, 1], dtype=np.uint8),
    )
    batch = collate([group], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 5, 6, 7, 2, 0], [1, 5, 6, 8, 9, 10]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    # position j describes target input_ids[:, j + 1]; completions start at target index 3 -> j = 2
    assert batch.completion_mask.tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 0, 1]]
    torch.testing.assert_close(batch.behaviour_logprobs[1], torch.tensor([0, 0, -0.3, -0.4, -0.5]))
    assert batch.token_versions.tolist() == [[-1, -1, 3, 3, -1], [-1, -1, 3, 4, 4]]
    assert batch.rewards.tolist() == [1.0, 0.0] and batch.group_index.tolist() == [0, 0]
