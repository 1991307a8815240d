"""Checkpoints restore model, optimizer and offsets exactly; writes are atomic; old ones are pruned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from trainer.checkpoint import CheckpointFormatError, load_latest_checkpoint, offsets_by_topic, save_checkpoint

OFFSETS = {"run.trajectories.main": {0: 12, 3: 7}, "run.trajectories.other": {1: 0}}


def _model(seed: int, tied: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)
    return AutoModelForCausalLM.from_config(config)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 24, (4, 6), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize("tied", [False, True])
def test_resume_restores_model_optimizer_and_offsets_exactly(tmp_path: Path, tied: bool):
    model = _model(0, tied)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.99))
    _train(model, opt, steps=3, seed=1)
    save_checkpoint(tmp_path, model=model, optimizer=opt, version=3, offsets=OFFSETS, extra={"groups": 96})

    ckpt = load_latest_checkpoint(tmp_path)
    assert ckpt is not None
    assert ckpt.version == 3 and ckpt.offsets == OFFSETS and ckpt.extra == {"groups": 96}
    fresh = _model(42, tied)  # different init: everything must come from the checkpoint
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2, betas=(0.9, 0.99))
    ckpt.restore(fresh, fresh_opt)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    if tied:
        assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()

    # Continuing from the restored state is bit-identical to never having stopped.
    _train(model, opt, steps=2, seed=9)
    _train(fresh, fresh_opt, steps=2, seed=9)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


def test_latest_wins_old_ones_are_pruned_and_partial_writes_are_ignored(tmp_path: Path):
    assert load_latest_checkpoint(tmp_path) is None
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for version in (5, 10, 15):
        save_checkpoint(tmp_path, model=model, optimizer=opt, version=version,
                        offsets={"t": {0: version}}, keep=2)
    (tmp_path / ".tmp-v00000020-crashed").mkdir()  # a writer that died before its rename
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["v00000010", "v00000015"]
    latest = load_latest_checkpoint(tmp_path)
    assert latest.version == 15 and latest.offsets == {"t": {0: 15}}
    with pytest.raises(FileExistsError):
        save_checkpoint(tmp_path, model=model, optimizer=opt, version=15, offsets={})


def test_a_checkpoint_in_the_earlier_format_is_refused_with_what_to_do(tmp_path: Path):
    old = tmp_path / "v00000007"
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"")
    (old / "meta.json").write_text('{"version": 7, "offsets": {}}')
    with pytest.raises(CheckpointFormatError, match="earlier rlbus"):
        load_latest_checkpoint(tmp_path)


def test_lag_across_a_resume_counts_steps_from_the_checkpoint() -> None:
    """Checkpoint at v20 (step 20); the store had reached v30 before the crash, so the resumed
    weights went out as v31; two steps later the trainer is at v33, step 22."""
    from trainer.loop import Fork, TrainerState

    plain = TrainerState(version=10)
    assert plain.step == 10 and plain.lag(7) == 3 and plain.lag(10) == 0
    state = TrainerState(version=33, step=22, fork=Fork(version=20, step=20, resumed_at=31))
    assert state.lag(33) == 0 and state.lag(31) == 2  # published after the resume
    assert state.lag(25) == 2 + 5  # the lost branch: 5 steps off the checkpoint, 2 steps since
    assert state.lag(30) == 2 + 10 and state.lag(20) == 2 and state.lag(18) == 2 + 2  # before the checkpoint


def test_the_value_model_goes_with_the_policys_checkpoint(tmp_path: Path):
    from trainer.value import ValueModel

    def value_model(seed: int) -> ValueModel:
        base = _model(seed).model  # the transformer without its LM head
        torch.manual_seed(seed)
        critic = ValueModel(base, 16)
        torch.nn.init.normal_(critic.head.weight)
        return critic

    model, critic = _model(0), value_model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    value_opt = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    _train(model, opt, steps=1, seed=1)
    ids = torch.randint(0, 24, (2, 5))
    (critic(ids, torch.ones_like(ids)) ** 2).mean().backward()
    value_opt.step()
    save_checkpoint(tmp_path, model=model, optimizer=opt, version=1, offsets={}, value=(critic, value_opt))
    ckpt = load_latest_checkpoint(tmp_path)
    fresh = value_model(7)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert ckpt.restore_value(fresh, fresh_opt)
    assert all(torch.equal(a, b) for a, b in zip(critic.state_dict().values(), fresh.state_dict().values()))
    assert fresh_opt.state_dict()["state"].keys() == value_opt.state_dict()["state"].keys()
    # A checkpoint of a trainer without a value model says so.
    save_checkpoint(tmp_path, model=model, optimizer=opt, version=2, offsets={})
    assert not load_latest_checkpoint(tmp_path).restore_value(fresh, fresh_opt)


def test_offsets_of_several_topics_round_trip_and_a_one_topic_checkpoint_still_resumes(tmp_path: Path):
    """A trainer that read its topic and a region's mirror keeps the offsets of both per topic; a
    checkpoint of a trainer that read its own topic only (written before mirrors were read) gives
    the same offsets of that topic, and none of any other."""
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    own, mirror = "run.trajectories.main", "us-east.run.trajectories.main"
    read = {(own, 0): 12, (own, 3): 7, (mirror, 1): 4}
    save_checkpoint(tmp_path / "new", model=model, optimizer=opt, version=3, offsets=offsets_by_topic(read))
    ours = (own, mirror).__contains__
    assert load_latest_checkpoint(tmp_path / "new").partition_offsets(ours) == read

    old = save_checkpoint(tmp_path / "old", model=model, optimizer=opt, version=3, offsets={own: {0: 12, 3: 7}})
    assert json.loads((old / "meta.json").read_text())["offsets"] == {own: {"0": 12, "3": 7}}  # the format it had
    ckpt = load_latest_checkpoint(tmp_path / "old")
    assert ckpt.partition_offsets(ours) == {(own, 0): 12, (own, 3): 7}
    assert ckpt.partition_offsets(lambda t: t == mirror) == {}
