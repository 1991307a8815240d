"""Step-level credit (SALT): the trajectory graph of a group's episodes, and the per-turn advantages
the trainer takes from it, on hand-built groups whose right answers are worked out below."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from broker.codec import decode_group, encode_group
from broker.errors import RecordError
from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader
from consumers.stages import StageSpec, apply_group_stages, build_group_stages
from consumers.stages.base import select_samples
from consumers.stages.credit import StepCredit, step_nodes
from rlbus.config import RunConfig
from rlbus.policies import resolve_policies
from trainer.batch import advantages, collate, drop_zero_advantage, step_advantages

PROMPT = [1, 2]


def _episode(*steps: list[int]) -> tuple[list[int], list[list[int]]]:
    """Tokens and turn spans of an episode written as action, observation, action, ... (token lists)."""
    tokens, turns = [], []
    for k, part in enumerate(steps):
        if k % 2 == 0:
            turns.append([len(tokens), len(tokens) + len(part)])
        tokens += part
    return tokens, turns


def _group(episodes: list[tuple[list[int], list[list[int]]]], rewards: list[float], gid: str = "g") -> TrajectoryGroup:
    tokens = np.concatenate([np.asarray(t, np.int32) for t, _ in episodes])
    offsets = np.cumsum([0] + [len(t) for t, _ in episodes]).astype(np.int32)
    mask = np.concatenate([np.asarray([int(any(s <= j < e for s, e in turns)) for j in range(len(t))], np.uint8)
                           for t, turns in episodes])
    header = TrajectoryHeader(
        run="r", policy="main", group_id=gid, prompt_id=gid, task="textgame", worker_id="w",
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4), rewards=rewards,
        finish_reasons=["stop"] * len(episodes), min_version=0, max_version=0, vocab_size=100,
        created_at=time.time(), turns=[turns for _, turns in episodes])
    return TrajectoryGroup(header=header, prompt_tokens=np.asarray(PROMPT, np.int32), completion_tokens=tokens,
                           completion_offsets=offsets, behaviour_logprobs=np.full(len(tokens), -0.1, np.float32),
                           token_versions=np.zeros(len(tokens), np.int32), loss_mask=mask)


# Four episodes of two turns; actions 10/11 first, 20/21 second; the game answers 50 or 51.
WON_A = _episode([10], [50], [20])  # the winning path
LOST_A = _episode([10], [50], [21])  # same first step, wrong second step
LOST_B = _episode([11], [50], [20])  # another first step, then the winners' second step
REWARDS = [1.0, 0.0, 0.0, 1.0]


def _four() -> TrajectoryGroup:
    return _group([WON_A, LOST_A, LOST_B, WON_A], REWARDS)


def test_history_merge_is_the_prefix_tree_of_the_groups_episodes() -> None:
    # Node 0: first step 10 (samples 0, 1, 3); 1: 10 then 20 (0, 3); 2: 10 then 21; 3: 11; 4: 11 then 20.
    assert step_nodes(_four(), "history") == [[0, 1], [0, 2], [3, 4], [0, 1]]


def test_state_merge_joins_the_same_action_on_the_same_observation_whatever_came_before() -> None:
    # Sample 2's second step (20 after observation 50) is the winners' second step.
    assert step_nodes(_four(), "state") == [[0, 1], [0, 2], [3, 1], [0, 1]]


def _turn_advantages(group: TrajectoryGroup, scale: str = "none") -> list[list[float]]:
    batch = collate([group], pad_id=0)
    per_token = step_advantages(advantages(batch.rewards, batch.group_index, scale), batch.step_node,
                                batch.step_bonus)
    p = len(group.prompt_tokens)
    return [[float(per_token[i, p - 1 + start]) for start, _ in spans] for i, spans in enumerate(group.header.turns)]


def _close(got: list[list[float]], expected: list[list[float]]) -> bool:
    return [len(r) for r in got] == [len(r) for r in expected] and \
        [x for r in got for x in r] == pytest.approx([x for r in expected for x in r], abs=1e-6)


def test_each_turn_gets_the_mean_outcome_advantage_of_the_samples_through_its_node() -> None:
    # Outcome advantages (mean-centred): +0.5, −0.5, −0.5, +0.5.
    history = apply_group_stages([StepCredit()], [_four()], 0)[0]
    expected = [[1 / 6, 0.5], [1 / 6, -0.5], [-0.5, -0.5], [1 / 6, 0.5]]  # node 0: (0.5 − 0.5 + 0.5) / 3
    assert _close(_turn_advantages(history), expected)
    state = apply_group_stages([StepCredit(StepCredit.Config(merge="state"))], [_four()], 0)[0]
    # The winners' second step, taken by sample 2 as well: (0.5 − 0.5 + 0.5) / 3.
    assert _close(_turn_advantages(state), [[1 / 6, 1 / 6], [1 / 6, -0.5], [-0.5, 1 / 6], [1 / 6, 1 / 6]])


def test_a_step_every_episode_shares_gets_no_credit_and_the_algorithms_scale_is_kept() -> None:
    group = apply_group_stages([StepCredit()], [_group([WON_A, LOST_A], [1.0, 0.0])], 0)[0]
    # Outcome advantages ÷ std: ±0.7071; the shared first step averages to 0, the second keeps its own.
    got = _turn_advantages(group, scale="std")
    assert got[0][0] == pytest.approx(0.0, abs=1e-6) and got[1][0] == pytest.approx(0.0, abs=1e-6)
    assert got[0][1] == pytest.approx(2**-0.5, rel=1e-4) and got[1][1] == pytest.approx(-(2**-0.5), rel=1e-4)


def test_a_sample_that_passes_a_node_twice_counts_once() -> None:
    loop = _episode([10], [50], [10], [50], [10])  # the same step three times (state merge): one node
    group = _group([loop, WON_A], [0.0, 1.0])
    assert step_nodes(group, "state") == [[0, 1, 1], [0, 2]]
    credited = apply_group_stages([StepCredit(StepCredit.Config(merge="state"))], [group], 0)[0]
    # Node 1 holds sample 0 alone (−0.5), however often; node 0 both samples (0).
    assert _close(_turn_advantages(credited), [[0.0, -0.5, -0.5], [0.0, 0.5]])


def test_without_a_graph_every_token_has_its_samples_advantage() -> None:
    batch = collate([_four()], pad_id=0)
    adv = advantages(batch.rewards, batch.group_index, "none")
    assert step_advantages(adv, batch.step_node) is adv
    # Groups of a batch get disjoint node ids: the same node numbers in two groups are not one node.
    both = apply_group_stages([StepCredit()], [_four(), _group([WON_A, LOST_A], [0.0, 1.0], gid="h")], 0)
    batch = collate(both, pad_id=0)
    per_token = step_advantages(advantages(batch.rewards, batch.group_index, "none"), batch.step_node)
    assert float(per_token[0, 1]) == pytest.approx(1 / 6) and float(per_token[4, 1]) == pytest.approx(0.0)
    kept, _ = drop_zero_advantage(batch, per_token)
    assert kept.num_samples == 6


def test_the_graph_travels_with_the_group_and_bad_turns_are_refused() -> None:
    credited = apply_group_stages([StepCredit()], [_four()], 0)[0]
    back = decode_group(encode_group(credited))
    assert back.header.turns == credited.header.turns and back.header.turn_nodes == [[0, 1], [0, 2], [3, 4], [0, 1]]
    assert select_samples(back, [2, 0]).header.turn_nodes == [[3, 4], [0, 1]]
    bad = _four()
    bad.header = bad.header.model_copy(update={"turns": [[[0, 1], [2, 9]]] + bad.header.turns[1:]})
    with pytest.raises(RecordError, match=r"turn \[2, 9\]"):
        decode_group(encode_group(bad))


def test_single_turn_groups_pass_and_the_stage_needs_a_group_estimator() -> None:
    plain = _four()
    plain.header = plain.header.model_copy(update={"turns": None})
    assert apply_group_stages([StepCredit()], [plain], 0)[0] is plain
    assert build_group_stages([StageSpec(type="step_credit", params={"merge": "state"})])[0].config.merge == "state"
    with pytest.raises(ValueError, match="step_credit"):
        RunConfig.model_validate({"trainer": {"algorithm": "vapo"}, "trainer_stages": [{"type": "step_credit"}]})
    accepted = RunConfig.model_validate({"trainer": {"algorithm": "dr_grpo"}, "trainer_stages": [{"type": "step_credit"}]})
    (policy,) = resolve_policies(accepted)  # what the trainer is built from: the stage on a group estimator
    assert policy.trainer.advantage_estimator == "group"
    assert [spec.type for spec in policy.trainer_stages] == ["step_credit"]
    assert torch.equal(collate([plain], 0).step_node, torch.full_like(collate([plain], 0).step_node, -1))


def test_gigpo_compares_the_steps_taken_from_the_same_observation_and_adds_that_to_the_episodes_advantage() -> None:
    stage = StepCredit(StepCredit.Config(method="gigpo", gamma=0.5, scale="none"))
    odd = _episode([10], [51], [21])  # reaches observation 51, which no other episode sees
    group = apply_group_stages([stage], [_group([WON_A, LOST_A, LOST_B, WON_A, odd], [1.0, 0.0, 0.0, 1.0, 0.0])], 0)[0]
    # First turns (the prompt, one anchor): returns 0.5·reward = 0.5, 0, 0, 0.5, 0 → centred on 0.2.
    # Second turns at observation 50: returns 1, 0, 0, 1 → centred on 0.5; sample 4's is alone: 0.
    assert _close(group.header.turn_advantages, [[0.3, 0.5], [-0.2, -0.5], [-0.2, -0.5], [0.3, 0.5], [-0.2, 0.0]])
    assert group.header.turn_nodes is None
    # The trainer adds them to the episodes' own advantages (mean-centred rewards: 0.6, −0.4, …).
    assert _close(_turn_advantages(group), [[0.9, 1.1], [-0.6, -0.9], [-0.6, -0.9], [0.9, 1.1], [-0.6, -0.4]])
    back = decode_group(encode_group(group))
    assert back.header.turn_advantages == group.header.turn_advantages
    bad = group.header.model_copy(update={"turn_advantages": [[0.0]] * 5})
    with pytest.raises(RecordError, match="one advantage per turn"):
        decode_group(encode_group(TrajectoryGroup(**{**group.__dict__, "header": bad})))
