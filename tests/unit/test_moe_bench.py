"""The building blocks of ``benchmarks.moe`` on a tiny scratch mixture-of-experts policy (hidden 32, 2 layers,
4 experts, top-2) and a few addition prompts: routing recorded by the torch engine, its coded size, the
trainer's mismatch on the engine's own numerics, and the expert-balanced plan. Not the benchmark itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.moe import imbalance, mismatch, record_groups, routing_size
from consumers.dataset import read_rows
from producers.engines.torch_engine import TorchEngine
from rlbus.examples.addition import AdditionTask, build_tokenizer, write_dataset
from rlbus.examples.scratch import build_checkpoint
from trainer.model import load_policy


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The tiny policy (the trainer's copy), its pad id, and 12 groups of 4 samples the engine recorded."""
    tmp = tmp_path_factory.mktemp("moe-bench")
    model_dir = build_checkpoint(tmp / "m", build_tokenizer(), arch="qwen3_moe", hidden_size=32, layers=2, heads=4,
                                 kv_heads=2, num_experts=4, top_k=2, moe_intermediate_size=32)
    _, heldout = write_dataset(tmp / "data", seed=0, max_operand=10, n_heldout=12)
    engine = TorchEngine(model_dir, device="cpu", seed=0)
    groups = record_groups(engine, AdditionTask(), read_rows(heldout), group_size=4, temperature=1.0,
                           max_new_tokens=4)
    lm, tokenizer = load_policy(Path(model_dir), "float32", device="cpu")
    return lm, tokenizer.pad_token_id, groups


def test_groups_carry_the_recorded_routing(recorded) -> None:
    _, _, groups = recorded
    assert len(groups) == 12 and all(g.group_size == 4 for g in groups)
    for g in groups:
        assert g.routed_experts.shape == (len(g.prompt_tokens) - 1 + len(g.completion_tokens), 2, 2)
        assert (g.routed_experts >= 0).all() and (g.routed_experts < 4).all()


def test_routing_bytes_are_positive_and_below_the_raw_int16(recorded) -> None:
    figures = routing_size(recorded[2])
    assert 0 < figures["routing_section_bytes_per_token"] < figures["routing_raw_bytes_per_token"]
    assert 0 < figures["routing_bytes_per_token"] < figures["routing_raw_bytes_per_token"]
    assert 0 < figures["routing_entropy_bytes_per_token"] < figures["routing_raw_bytes_per_token"]
    assert figures["routing_raw_bytes_per_token"] == pytest.approx(
        sum(g.routed_experts.size * 2 for g in recorded[2]) / figures["completion_tokens"], abs=1e-3)


@pytest.mark.parametrize("shared_prefix", [True, False])
def test_on_the_engines_numerics_nothing_flips_and_replay_changes_nothing(recorded, shared_prefix: bool) -> None:
    lm, pad_id, groups = recorded
    figures = mismatch(lm, groups, pad_id, autocast=None, shared_prefix=shared_prefix)
    assert figures["flip_rate"] == 0 and figures["flip_rate_all_positions"] == 0
    assert figures["logprob_gap_replay"] < 1e-4 and figures["logprob_gap_no_replay"] < 1e-4
    assert figures["ratio_std_replay"] < 1e-4
    bf16 = mismatch(lm, groups, pad_id, autocast=torch.bfloat16, shared_prefix=shared_prefix)
    assert 0 <= bf16["flip_rate"] <= 1 and bf16["logprob_gap_replay"] >= 0  # runs under autocast; no claim on size


@pytest.mark.parametrize(("world", "budget"), [(1, 40), (2, 16)])  # budgets where balancing changes the plan
def test_the_balanced_plan_is_no_more_uneven_than_arrival_order(recorded, world: int, budget: int) -> None:
    _, pad_id, groups = recorded
    figures = imbalance(groups, pad_id, budget=budget, world=world)
    arrival, balanced = figures["arrival"], figures["balanced"]
    assert arrival["micro_batches"] > 1
    assert balanced["passes"] <= arrival["passes"]
    key = "slowdown" if world == 1 else "pass_slowdown"
    assert balanced[key] <= arrival[key] + 1e-9
