"""Data-algorithm stages on crafted trajectory groups: each stage's effect, and the registry.

Every crafted group has read-only columns (as decoded records may have), so a stage that wrote
into an input array would fail here.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from pydantic import Field

from broker.schema import COLUMNS, SamplingParams, TrajectoryGroup, TrajectoryHeader
from consumers.stages import (
    DynamicSampling,
    GresoSkip,
    GroupStage,
    MaxVarianceDownsample,
    OverlongFilter,
    PromptStage,
    Replay,
    SkipSolved,
    SoftOverlongPunishment,
    StageConfig,
    check_consistent,
    max_variance_subset,
    registry,
    replace_group,
    select_samples,
)


def _group(rewards, lengths=None, finish=None, gid="g0", min_version=0) -> TrajectoryGroup:
    n = len(rewards)
    lengths = [3] * n if lengths is None else lengths
    total = sum(lengths)
    header = TrajectoryHeader(
        run="r",
        policy="main",
        group_id=gid,
        prompt_id="p0",
        task="arith",
        worker_id="w0",
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=16),
        rewards=[float(r) for r in rewards],
        finish_reasons=finish or ["stop"] * n,
        min_version=min_version,
        max_version=min_version,
        vocab_size=1000,
        created_at=1.0,
        signature="ab" * 32,
    )
    group = TrajectoryGroup(
        header=header,
        prompt_tokens=np.array([1, 2], dtype=np.int32),
        completion_tokens=np.arange(100, 100 + total, dtype=np.int32),
        completion_offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32),
        behaviour_logprobs=-np.arange(total, dtype=np.float32) / 10,
        token_versions=np.full(total, min_version, dtype=np.int32),
        loss_mask=np.ones(total, dtype=np.uint8),
    )
    for name, _ in COLUMNS:
        getattr(group, name).setflags(write=False)
    return group


class ClipRewards(GroupStage):
    """A user stage, named by its import path in the registry tests."""

    class Config(StageConfig):
        limit: float = Field(default=1.0, gt=0.0, description="Rewards are clipped to [-limit, limit].")

    def process(self, groups, *, version):
        limit = self.config.limit
        out = [replace_group(g, header={"rewards": [max(-limit, min(limit, r)) for r in g.header.rewards]}) for g in groups]
        self.count("modified_samples", sum(g.group_size for g in groups))
        return out


NOT_A_CLASS = 42


# -- helpers -----------------------------------------------------------------------------------
def test_select_samples_cuts_every_column_together():
    group = _group([0.0, 1.0, 2.0], lengths=[2, 0, 3], finish=["stop", "length", "abort"])
    sub = select_samples(group, [2, 0])
    assert sub.header.rewards == [2.0, 0.0] and sub.header.finish_reasons == ["abort", "stop"]
    assert sub.completion_offsets.tolist() == [0, 3, 5]
    assert sub.completion_tokens.tolist() == [102, 103, 104, 100, 101]
    assert np.allclose(sub.behaviour_logprobs, [-0.2, -0.3, -0.4, 0.0, -0.1])
    assert sub.header.signature is None and group.header.signature is not None
    check_consistent(sub)
    labelled = select_samples(replace_group(group, header={"subgroups": [5, 6, 7]}), [2, 0])
    assert labelled.header.subgroups == [7, 5]
    with pytest.raises(ValueError, match="2 subgroups"):
        replace_group(group, header={"subgroups": [0, 1]})
    with pytest.raises(ValueError, match="at least one sample"):
        select_samples(group, [])


def test_replace_group_rejects_inconsistent_columns():
    group = _group([0.0, 1.0])
    with pytest.raises(ValueError, match="loss_mask has 2 tokens"):
        replace_group(group, loss_mask=np.ones(2, dtype=np.uint8))
    with pytest.raises(ValueError, match="3 rewards"):
        replace_group(group, header={"rewards": [0.0, 1.0, 2.0]})


# -- group stages ------------------------------------------------------------------------------
def test_dynamic_sampling_drops_zero_advantage_groups():
    stage = DynamicSampling()
    groups = [_group([1, 1, 1], gid="same"), _group([0, 1, 0], gid="mixed"), _group([0.5], gid="single")]
    assert [g.header.group_id for g in stage.process(groups, version=0)] == ["mixed"]
    assert stage.report()["dropped"] == 2 and stage.report()["added"] == 0
    loose = DynamicSampling(DynamicSampling.Config(tolerance=0.1))
    assert loose.process([_group([0.0, 0.05])], version=0) == []
    # In subgroups, only a spread within one subgroup is signal.
    flat = replace_group(_group([0, 0, 1, 1], gid="flat"), header={"subgroups": [0, 0, 1, 1]})
    spread = replace_group(_group([0, 1, 1, 1], gid="spread"), header={"subgroups": [0, 0, 1, 1]})
    assert [g.header.group_id for g in stage.process([flat, spread], version=0)] == ["spread"]


def test_overlong_filter_masks_truncated_samples_only():
    group = _group([0, 1, 1], lengths=[2, 3, 1], finish=["stop", "length", "length"])
    stage = OverlongFilter()
    (out,) = stage.process([group], version=0)
    assert out.loss_mask.tolist() == [1, 1, 0, 0, 0, 0]
    assert group.loss_mask.tolist() == [1] * 6  # input untouched
    assert out.header.rewards == group.header.rewards
    untouched = _group([0, 1])
    assert stage.process([untouched], version=0)[0] is untouched
    assert stage.report() == {"dropped": 0.0, "added": 0.0, "modified_samples": 2.0}


@pytest.mark.parametrize(
    ("length", "penalty"),
    [(0, 0.0), (6, 0.0), (7, -0.25), (8, -0.5), (9, -0.75), (10, -1.0), (11, -1.0), (40, -1.0)],
)
def test_soft_overlong_penalty_at_boundaries(length, penalty):
    stage = SoftOverlongPunishment(SoftOverlongPunishment.Config(max_length=10, cache_length=4))
    assert stage.penalty(np.array([length]))[0] == pytest.approx(penalty)


def test_soft_overlong_adds_penalty_to_rewards():
    stage = SoftOverlongPunishment(SoftOverlongPunishment.Config(max_length=10, cache_length=4))
    group = _group([1.0, 1.0, 0.0], lengths=[6, 8, 12])
    (out,) = stage.process([group], version=0)
    assert out.header.rewards == pytest.approx([1.0, 0.5, -1.0])
    assert group.header.rewards == [1.0, 1.0, 0.0]
    assert stage.report()["modified_samples"] == 2
    short = _group([1.0, 0.0], lengths=[2, 6])
    assert stage.process([short], version=0)[0] is short
    whole = SoftOverlongPunishment(SoftOverlongPunishment.Config(max_length=4, cache_length=4))
    assert whole.penalty(np.array([0, 1, 4])).tolist() == pytest.approx([0.0, -0.25, -1.0])
    with pytest.raises(ValueError, match="must not exceed"):
        SoftOverlongPunishment.Config(max_length=3, cache_length=4)


def test_pods_subset_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(3, 9))
        m = int(rng.integers(2, n))
        rewards = rng.integers(0, 4, size=n).astype(float) if rng.random() < 0.5 else rng.normal(size=n)
        chosen = max_variance_subset(list(rewards), m)
        assert len(chosen) == m and len(set(chosen)) == m
        best = max(np.var(rewards[list(c)]) for c in itertools.combinations(range(n), m))
        assert np.var(rewards[chosen]) == pytest.approx(best, abs=1e-12)


def test_pods_keeps_top_and_bottom_samples():
    # Sorted: 0 (idx 3), 0.1 (idx 1), 0.5 (idx 4), 0.9 (idx 0), 1.0 (idx 2), 1.0 (idx 5).
    group = _group([0.9, 0.1, 1.0, 0.0, 0.5, 1.0], lengths=[1, 2, 3, 4, 5, 6])
    stage = MaxVarianceDownsample(MaxVarianceDownsample.Config(keep=4))
    (out,) = stage.process([group], version=0)
    assert sorted(out.header.rewards) == [0.0, 0.1, 1.0, 1.0]
    assert out.completion_offsets.tolist() == [0, 2, 5, 9, 15]  # samples 1, 2, 3, 5 in order
    assert out.completion_tokens[:2].tolist() == group.completion_tokens[group.sample(1)].tolist()
    check_consistent(out)
    assert stage.report()["dropped_samples"] == 2
    small = _group([0.0, 1.0])
    assert stage.process([small], version=0)[0] is small


def _replay_ids(out):
    return sorted(g.header.group_id for g in out if "/replay" in g.header.group_id)


def test_replay_respects_staleness_bound():
    stage = Replay(Replay.Config(max_staleness=2, ratio=1.0, max_uses=5))
    stage.process([_group([0, 1], gid="old", min_version=5)], version=5)
    assert _replay_ids(stage.process([_group([0, 1], gid="a", min_version=7)], version=7)) == ["old/replay1"]
    out = stage.process([_group([0, 1], gid="b", min_version=8)], version=8)
    assert _replay_ids(out) == ["a/replay1"]  # 8 - 5 > 2: "old" expired
    assert stage.report()["expired"] >= 1


def test_replay_never_exceeds_max_uses():
    stage = Replay(Replay.Config(max_staleness=100, ratio=1.0, max_uses=2))
    stage.process([_group([0, 1], gid="x")], version=0)
    seen = []
    for v in range(1, 6):
        out = stage.process([_group([1, 1], gid=f"flat{v}")], version=v)  # no signal: nothing to replay against
        assert _replay_ids(out) == []
        out = stage.process([_group([0, 1], gid=f"n{v}")], version=v)
        seen += [i for i in _replay_ids(out) if i.startswith("x/")]
    assert seen == ["x/replay1", "x/replay2"]
    assert stage.report()["added"] == 5  # one per round, always of a different group once x ran out


def test_replay_count_and_copies():
    stage = Replay(Replay.Config(max_staleness=10, ratio=0.5, capacity=3, seed=1))
    first = [_group([0, 1], gid=f"a{i}") for i in range(4)] + [_group([1, 1], gid="flat")]
    out = stage.process(first, version=0)
    assert out == first and stage.buffered == 3 and stage.report()["evicted"] == 1
    batch = [_group([0, 1], gid=f"b{i}") for i in range(3)]
    out = stage.process(batch, version=1)
    replayed = out[3:]
    assert len(replayed) == 2  # round(0.5 × 3) half up
    assert all(r.header.group_id.split("/")[0] in {"a1", "a2", "a3"} for r in replayed)
    assert all(r.header.group_id.endswith("/replay1") for r in replayed)
    assert all(r.header.group_id != "flat" for r in replayed)


# -- prompt stages -----------------------------------------------------------------------------
def test_skip_solved_uses_ewma_after_min_observations():
    stage = SkipSolved(SkipSolved.Config(alpha=0.5, threshold=0.8, min_observations=2))
    rng = random.Random(0)
    stage.observe("p", [1.0, 1.0])
    assert stage.admit("p", rng)  # one observation only
    stage.observe("p", [1.0, 0.0])
    assert stage.success("p") == pytest.approx(0.75) and stage.admit("p", rng)
    stage.observe("p", [1.0, 1.0])
    assert stage.success("p") == pytest.approx(0.875) and not stage.admit("p", rng)
    assert stage.admit("other", rng)
    assert stage.report() == {"admitted": 3.0, "skipped": 1.0, "observed": 3.0, "rechecked": 0.0}


def test_skip_solved_recheck_is_deterministic_with_seeded_rng():
    def decisions(seed):
        stage = SkipSolved(SkipSolved.Config(threshold=0.5, min_observations=1, recheck_prob=0.3))
        stage.observe("p", [1.0])
        rng = random.Random(seed)
        return [stage.admit("p", rng) for _ in range(200)]

    assert decisions(7) == decisions(7)
    assert 30 < sum(decisions(7)) < 90  # about 30 % rechecked


def test_greso_skip_probability_grows_with_zero_variance_streak():
    stage = GresoSkip(GresoSkip.Config(base_skip_prob=0.5, max_skip_prob=0.8))
    assert stage.skip_probability("p") == 0.0
    stage.observe("p", [1.0, 1.0])
    assert stage.skip_probability("p") == pytest.approx(0.5)
    stage.observe("p", [0.0, 0.0])
    assert stage.skip_probability("p") == pytest.approx(0.75)
    stage.observe("p", [1.0, 1.0])
    assert stage.streak("p") == 3 and stage.skip_probability("p") == pytest.approx(0.8)  # capped
    stage.observe("p", [0.0, 1.0])
    assert stage.streak("p") == 0 and stage.admit("p", random.Random(0))


def test_greso_is_deterministic_with_seeded_rng():
    def decisions(seed):
        stage = GresoSkip(GresoSkip.Config(base_skip_prob=0.5, max_skip_prob=0.9))
        stage.observe("p", [1.0, 1.0])
        rng = random.Random(seed)
        return [stage.admit("p", rng) for _ in range(400)]

    assert decisions(3) == decisions(3)
    assert decisions(3) != decisions(4)
    assert 150 < sum(decisions(3)) < 250  # admitted about half the time


# -- registry ----------------------------------------------------------------------------------
def test_registry_builds_builtin_stages_with_params():
    stages = registry.build_group_stages(
        [
            {"type": "overlong_filter"},
            registry.StageSpec(type="soft_overlong", params={"max_length": 10, "cache_length": 4}),
            {"type": "pods", "params": {"keep": 2}},
            {"type": "dynamic_sampling"},
            {"type": "replay", "params": {"max_staleness": 1}},
        ]
    )
    assert [s.name for s in stages] == ["overlong_filter", "soft_overlong", "pods", "dynamic_sampling", "replay"]
    assert stages[2].config.keep == 2
    prompts = registry.build_prompt_stages([{"type": "skip_solved", "params": {"threshold": 0.7}}, {"type": "greso"}])
    assert isinstance(prompts[0], SkipSolved) and prompts[0].config.threshold == 0.7
    assert isinstance(prompts[1], GresoSkip)


def test_apply_group_stages_runs_in_order():
    specs = [{"type": "soft_overlong", "params": {"max_length": 4, "cache_length": 2}}, {"type": "dynamic_sampling"}]
    stages = registry.build_group_stages(specs)
    # Equal rewards, but the long sample is penalised first: the group now has signal and stays.
    groups = [_group([1.0, 1.0], lengths=[1, 4]), _group([1.0, 1.0], lengths=[1, 2], gid="flat")]
    out = registry.apply_group_stages(stages, groups, version=0)
    assert [g.header.group_id for g in out] == ["g0"] and out[0].header.rewards == [1.0, 0.0]
    metrics = registry.stage_metrics(stages)
    assert metrics["dynamic_sampling/dropped"] == 1 and metrics["soft_overlong/modified_samples"] == 1
    assert metrics["dynamic_sampling/seconds"] > 0 and metrics["soft_overlong/seconds"] > 0  # each stage's own time


def test_prompt_stage_helpers_ask_every_stage():
    specs = [{"type": "skip_solved", "params": {"min_observations": 1}}, {"type": "greso"}]
    stages = registry.build_prompt_stages(specs)
    registry.observe_prompt(stages, "p", [1.0, 1.0])
    assert not registry.admit_prompt(stages, "p", random.Random(0))
    assert registry.admit_prompt(stages, "q", random.Random(0))


@pytest.mark.parametrize("path", ["tests.unit.test_stages:ClipRewards", "tests.unit.test_stages.ClipRewards"])
def test_registry_imports_user_stage(path):
    (stage,) = registry.build_group_stages([{"type": path, "params": {"limit": 0.5}}])
    assert stage.name == "ClipRewards"
    (out,) = stage.process([_group([-2.0, 0.2, 3.0])], version=0)
    assert out.header.rewards == [-0.5, 0.2, 0.5]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"type": "dapo"}, "unknown stage 'dapo': built-in stages are dynamic_sampling, greso"),
        ({"type": "no_such_pkg.mod:Stage"}, "cannot import module 'no_such_pkg.mod'"),
        ({"type": "tests.unit.test_stages:Missing"}, "has no attribute 'Missing'"),
        ({"type": "tests.unit.test_stages:NOT_A_CLASS"}, "is a int, not a GroupStage"),
        ({"type": "skip_solved"}, r"is not a GroupStage; it is a PromptStage"),
        ({"type": "consumers.stages:StageSpec"}, "is not a GroupStage; subclass GroupStage"),
        ({"type": "pods"}, r"\[0\] 'pods' has bad params: keep: Field required"),
        ({"type": "pods", "params": {"keep": 1}}, "keep: Input should be greater than or equal to 2"),
        ({"type": "dynamic_sampling", "params": {"tolerence": 0.1}}, "tolerence: Extra inputs are not permitted"),
        ({"type": "tests.unit.test_stages:ClipRewards", "params": {"limit": -1}}, "limit: Input should be greater than 0"),
    ],
)
def test_registry_errors_say_what_is_wrong(spec, message):
    with pytest.raises(registry.StageError, match=message):
        registry.build_group_stages([spec])


def test_registry_rejects_group_stage_among_prompt_stages():
    with pytest.raises(registry.StageError, match="is not a PromptStage; it is a GroupStage"):
        registry.build_prompt_stages([{"type": "pods", "params": {"keep": 2}}])
    with pytest.raises(registry.StageError, match="is not a PromptStage"):
        registry.build_prompt_stages([{"type": "tests.unit.test_stages:ClipRewards"}])
    assert issubclass(GresoSkip, PromptStage)
