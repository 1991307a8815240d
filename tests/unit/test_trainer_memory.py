"""Peak memory of a real trainer step at Qwen's 151,936-token vocabulary, each path in a process of
its own (``benchmarks.trainer_scale``): log-probs through the LM head in chunks need a fraction of
what whole [tokens × vocab] logits need, for the same loss and gradient."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.trainer_scale import OLD_PATH, build, run_one


def test_the_chunked_head_cuts_peak_memory_fourfold_at_a_151936_vocabulary(tmp_path: Path) -> None:
    model_dir = build("tiny", tmp_path)  # 19.5M parameters, 19.4M of them the embedding and the head
    batch = (4, 8, 16, 64)  # 2,048 completion tokens: 1.2 GB of float32 logits at once
    sets = ["device=cpu", "logits_chunk_mib=32"]
    new = run_one(model_dir, batch, 1, sets, ranks=1, timeout_s=600)
    old = run_one(model_dir, batch, 1, [*sets, *OLD_PATH], ranks=1, timeout_s=600)
    assert new is not None and old is not None
    assert old["peak_mem_gib"] >= 4 * new["peak_mem_gib"], (old["peak_mem_gib"], new["peak_mem_gib"])
    assert new["loss"] == pytest.approx(old["loss"], rel=1e-4, abs=1e-6)
    assert new["grad_norm"] == pytest.approx(old["grad_norm"], rel=1e-4)
