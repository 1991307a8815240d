"""Rollout Routing Replay on a real mixture-of-experts policy: the engine records the experts its routers
choose, the trainer's forward replays a plan (the experts used are the plan's, weighted by the live
router, whose weight still learns), through the plain and the shared-prefix forward alike, with and
without activation checkpointing, and ``collate`` lays the recorded routing out by input position."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from broker.schema import RoutingShape, SamplingParams, TrajectoryGroup, TrajectoryHeader
from producers.engines.base import GenerationResult, routed_experts
from producers.engines.torch_engine import TorchEngine
from rlbus.examples.scratch import build_checkpoint, train_bpe_tokenizer
from trainer.batch import TrainBatch, collate
from trainer.logprobs import PolicyModel, checkpoint_layers
from trainer.model import load_policy
from producers.engines.moe import find_routers

SHAPE = RoutingShape(layers=2, top_k=2, num_experts=4)
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer([f"{a} plus {b} is {a + b}." for a in range(30) for b in range(30)], vocab_size=200)


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("moe") / "m", tokenizer, arch="qwen3_moe", hidden_size=32,
                            layers=2, heads=4, kv_heads=2, num_experts=4, top_k=2, moe_intermediate_size=32,
                            norm_topk_prob=True)


def _own_choice(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """long [B, S, layers, top_k]: the experts the model picks itself, teacher-forced over ``ids`` [B, S]."""
    with torch.no_grad(), find_routers(model).record() as recorder:
        model(input_ids=ids, use_cache=False)
    return recorder.take().unflatten(0, tuple(ids.shape))


def _other_experts(chosen: torch.Tensor) -> torch.Tensor:
    """Per row, the experts not in ``chosen`` (4 experts, top-2: another valid top-k set), increasing."""
    unused = torch.ones(*chosen.shape[:-1], SHAPE.num_experts, dtype=torch.bool).scatter(-1, chosen, False)
    return unused.nonzero()[:, -1].view(chosen.shape)


def _group(i: int, prompt: list[int], samples: list[list[int]], vocab: int, routed: np.ndarray | None = None,
           behaviour: list[list[float]] | None = None) -> TrajectoryGroup:
    tokens = np.array([t for s in samples for t in s], dtype=np.int32)
    header = TrajectoryHeader(
        run="r", policy="main", group_id=f"g{i}", prompt_id=f"p{i}", task="t", worker_id="w", sampling=SAMPLING,
        rewards=[float(k) for k in range(len(samples))], finish_reasons=["stop"] * len(samples), min_version=0,
        max_version=0, vocab_size=vocab, created_at=time.time(), routing=None if routed is None else SHAPE)
    logp = np.array([x for s in behaviour for x in s] if behaviour else np.zeros(len(tokens)), dtype=np.float32)
    return TrajectoryGroup(
        header=header, prompt_tokens=np.array(prompt, dtype=np.int32), completion_tokens=tokens,
        completion_offsets=np.cumsum([0] + [len(s) for s in samples]).astype(np.int32), behaviour_logprobs=logp,
        token_versions=np.zeros(len(tokens), np.int32), routed_experts=routed)


def _batch(tokenizer, vocab: int) -> TrainBatch:
    """Two groups (prompts of 5 and 2 tokens; completions of 3, 1, 4 and 2, 3 tokens), no routing yet."""
    rng = np.random.default_rng(0)
    groups = []
    for g, (p_len, lengths) in enumerate(((5, (3, 1, 4)), (2, (2, 3)))):
        prompt = rng.integers(3, vocab, size=p_len).tolist()
        groups.append(_group(g, prompt, [rng.integers(3, vocab, size=n).tolist() for n in lengths], vocab))
    return collate(groups, pad_id=tokenizer.pad_token_id)


def _plan(model: torch.nn.Module, batch: TrainBatch) -> torch.Tensor:
    """A plan over the batch's input positions: the experts the model does not pick, -1 at every third
    position and outside the sequences."""
    plan = _other_experts(_own_choice(model, batch.input_ids))
    live = (torch.arange(plan.shape[1]) % 3 == 1)[None, :] | (batch.attention_mask == 0)
    return plan.masked_fill(live[:, :, None, None], -1)


@pytest.mark.parametrize("kv_cache", [True, False])
def test_the_engine_records_the_experts_the_trainer_picks(model_dir: Path, tokenizer, kv_cache: bool,
                                                          tmp_path: Path) -> None:
    model, _ = load_policy(model_dir, device="cpu")
    # The same weights with 50 stop tokens, so that samples leave the batch early.
    engine_dir = shutil.copytree(model_dir, tmp_path / "engine")
    config = json.loads((engine_dir / "config.json").read_text())
    (engine_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": list(range(3, 53))}))
    engine = TorchEngine(engine_dir, seed=0)
    engine.kv_cache = kv_cache
    assert engine.routing_shape == SHAPE
    prompts = [tokenizer(text)["input_ids"] for text in ("3 plus 4 is", "12", "7 plus 19 is 26. 1")]
    assert len({len(p) for p in prompts}) == 3  # left-padded to the longest, in one batch
    results = asyncio.run(engine.generate_batch(prompts, 3, SAMPLING))
    groups = []
    for i, (prompt, samples) in enumerate(zip(prompts, results, strict=True)):
        for sample in samples:
            assert sample.routing.dtype == np.int16 and sample.routing.shape == (len(sample.tokens), 2, 2)
            assert sample.prompt_routing.shape == (len(prompt) - 1, 2, 2)
            own = _own_choice(model, torch.tensor([prompt + sample.tokens]))[0]
            # Row t: the position that predicted token t; the prompt's rows: its positions 0..P-2.
            np.testing.assert_array_equal(sample.prompt_routing, own[: len(prompt) - 1].numpy())
            np.testing.assert_array_equal(sample.routing, own[len(prompt) - 1 : -1].numpy())
        routed = routed_experts(samples, len(prompt), engine.routing_shape)
        groups.append(_group(i, prompt, [s.tokens for s in samples], engine.vocab_size, routed,
                             [s.logprobs for s in samples]))
    assert len({len(s.tokens) for samples in results for s in samples}) > 1  # some samples stopped early
    # Replaying what the engine recorded, the trainer gives the engine's log-probs on both forward paths.
    batch = collate(groups, pad_id=tokenizer.pad_token_id)
    trained = batch.completion_mask > 0
    for shared_prefix in (True, False):
        with torch.no_grad():
            logp, _ = PolicyModel(model, shared_prefix=shared_prefix)(batch)
        torch.testing.assert_close(logp[trained], batch.behaviour_logprobs[trained], atol=1e-4, rtol=0)

    # A generation aborted mid-way (the model's one stop token is rare): its routing stops where its tokens do.
    engine = TorchEngine(model_dir, seed=0)
    engine.kv_cache = kv_cache
    engine.step_hook = lambda step: engine.abort_all() if step == 1 else None
    (aborted,) = asyncio.run(engine.generate_batch([prompts[0]], 2, SAMPLING))
    for sample in aborted:
        assert sample.finish_reason == "abort" and sample.routing.shape == (len(sample.tokens), 2, 2)
        own = _own_choice(model, torch.tensor([prompts[0] + sample.tokens]))[0]
        np.testing.assert_array_equal(sample.routing, own[len(prompts[0]) - 1 : -1].numpy())


def test_replay_routes_to_the_plan_with_the_live_router_weights(model_dir: Path, tokenizer) -> None:
    model, _ = load_policy(model_dir, device="cpu")
    batch = _batch(tokenizer, len(tokenizer))
    batch.routing = _plan(model, batch)
    routers = find_routers(model)
    blocks = [r for r in model.modules() if type(r).__name__ == "Qwen3MoeSparseMoeBlock"]
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # per MoE block: input, router weight, output
    hooks = [b.register_forward_hook(lambda m, args, out: seen.append((args[0], m.gate.weight, out))) for b in blocks]
    try:
        with torch.no_grad(), routers.record() as recorder:
            PolicyModel(model, shared_prefix=False)(batch)
    finally:
        for hook in hooks:
            hook.remove()
    used = recorder.take().unflatten(0, tuple(batch.input_ids.shape))
    given = batch.routing[..., 0] >= 0  # [N, L, layers]
    assert bool(given.any()) and bool((~given).any())
    assert torch.equal(used[given], batch.routing[given])  # the plan's experts where it gives them
    for layer, (block, (x, weight, out)) in enumerate(zip(blocks, seen, strict=True)):
        x = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(x @ weight.t(), dim=-1)
        live = ~given[..., layer].reshape(-1)
        # Elsewhere the router's own top-k of this (replayed) forward.
        own = probs[live].topk(2, dim=-1).indices.sort(-1).values
        assert torch.equal(used[..., layer, :].reshape(-1, 2)[live], own)
        # The block's output: the used experts weighted by the live probabilities, renormalised.
        chosen = used[..., layer, :].reshape(-1, 2)
        w = probs.gather(1, chosen)
        w = w / w.sum(-1, keepdim=True)
        manual = torch.zeros_like(x)
        for k in range(2):
            gate_up = torch.einsum("nh,nih->ni", x, block.experts.gate_up_proj[chosen[:, k]])
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = torch.nn.functional.silu(gate) * up
            manual += w[:, k, None] * torch.einsum("ni,nhi->nh", hidden, block.experts.down_proj[chosen[:, k]])
        torch.testing.assert_close(out.reshape(-1, x.shape[-1]), manual, atol=1e-5, rtol=1e-4)

    # With every position replayed, the router weights still receive gradients, through the replayed weights.
    full = _other_experts(_own_choice(model, batch.input_ids))
    batch.routing = full
    logp, _ = PolicyModel(model, shared_prefix=False)(batch)
    logp.sum().backward()
    for router in routers.modules:
        assert router.weight.grad is not None and float(router.weight.grad.abs().sum()) > 0
    # Replaying the model's own choice changes nothing; another choice changes the log-probs.
    with torch.no_grad():
        live, _ = PolicyModel(model, shared_prefix=False)(TrainBatch(**{**vars(batch), "routing": None}))
        own, _ = PolicyModel(model, shared_prefix=False)(
            TrainBatch(**{**vars(batch), "routing": _own_choice(model, batch.input_ids)}))
    torch.testing.assert_close(own, live, atol=1e-6, rtol=0)
    assert float((logp.detach() - live).abs().max()) > 1e-3


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe", "mixtral"])
def test_other_architectures_replay_alike(arch: str, tokenizer, tmp_path: Path) -> None:
    model_dir = build_checkpoint(tmp_path / arch, tokenizer, arch=arch, hidden_size=32, layers=2, heads=4, kv_heads=2,
                                 num_experts=4, top_k=2, moe_intermediate_size=32)
    model, _ = load_policy(model_dir, device="cpu")
    assert find_routers(model).shape == SHAPE
    batch = _batch(tokenizer, len(tokenizer))
    policy = PolicyModel(model, shared_prefix=True)
    with torch.no_grad():
        live, _ = policy(batch)
        own, _ = policy(TrainBatch(**{**vars(batch), "routing": _own_choice(model, batch.input_ids)}))
        batch.routing = _plan(model, batch)
        with find_routers(model).record() as recorder:
            replayed, _ = PolicyModel(model, shared_prefix=False)(batch)
    torch.testing.assert_close(own, live, atol=1e-6, rtol=0)
    used = recorder.take().unflatten(0, tuple(batch.input_ids.shape))
    given = batch.routing[..., 0] >= 0
    assert torch.equal(used[given], batch.routing[given])
    assert float((replayed - live).abs().max()) > 1e-3


def test_replay_is_the_same_through_every_path_and_under_checkpointing(model_dir: Path, tokenizer) -> None:
    model, _ = load_policy(model_dir, device="cpu")
    checkpointed, _ = load_policy(model_dir, device="cpu")
    assert checkpoint_layers(checkpointed) == 2
    batch = _batch(tokenizer, len(tokenizer))
    batch.routing = _plan(model, batch)
    trained = batch.completion_mask > 0
    weights = torch.linspace(-1.0, 1.0, trained.numel()).view(trained.shape)
    logps, grads = {}, {}
    for name, lm, options in (("plain", model, dict(shared_prefix=False)), ("shared", model, dict(shared_prefix=True)),
                              ("own forward", model, dict(shared_prefix=False, own_forward=True)),
                              ("shared, checkpointed", checkpointed, dict(shared_prefix=True)),
                              ("plain, checkpointed", checkpointed, dict(shared_prefix=False))):
        lm.zero_grad()
        logp, _ = PolicyModel(lm, **options)(batch)
        (logp * weights).sum().backward()
        logps[name] = logp.detach()
        grads[name] = {k: p.grad.clone() for k, p in lm.named_parameters() if p.grad is not None}
    for name in logps:
        torch.testing.assert_close(logps[name][trained], logps["plain"][trained], atol=1e-5, rtol=0)
    for path in ("shared", "plain"):  # checkpointing recomputes each layer with the plan its forward replayed
        ref, got = grads[path], grads[f"{path}, checkpointed"]
        assert set(ref) == set(got) and any("gate" in k for k in ref)
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], atol=1e-6, rtol=1e-5)
    for key in grads["plain"]:
        torch.testing.assert_close(grads["shared"][key], grads["plain"][key], atol=1e-5, rtol=1e-4)


def test_collate_lays_routing_out_by_input_position(tokenizer) -> None:
    def routed(rows: int) -> np.ndarray:
        return (np.arange(rows * 4, dtype=np.int16).reshape(rows, 2, 2) + 1)  # distinct per row

    # Group 0: prompt of 3, samples of 2 and 3 tokens; group 1: prompt of 1 (no prompt row), one sample of 2.
    a = _group(0, [5, 6, 7], [[8, 9], [10, 11, 12]], 200, routed(2 + 5))
    b = _group(1, [5], [[8, 9]], 200, routed(0 + 2))
    batch = collate([a, b], pad_id=0)
    assert batch.routing.dtype == torch.int16 and batch.routing.shape == (3, 6, 2, 2)
    expected = torch.full((3, 6, 2, 2), -1, dtype=torch.long)
    ra, rb = torch.from_numpy(a.routed_experts).long(), torch.from_numpy(b.routed_experts).long()
    expected[0, :2] = expected[1, :2] = ra[:2]  # the prompt's positions 0..P-2, shared by the samples
    expected[0, 2:4] = ra[2:4]  # sample 0's tokens 0, 1: predicted from columns 2, 3
    expected[1, 2:5] = ra[4:7]
    expected[2, 0:2] = rb[0:2]
    assert torch.equal(batch.routing, expected)
    assert collate([_group(0, [5, 6], [[8]], 200)], pad_id=0).routing is None
    # A worker's group of samples that recorded nothing (an episode of several passes): all -1, routed live.
    episode = GenerationResult(tokens=[8, 9], logprobs=[0.0, 0.0], versions=[0, 0], finish_reason="stop", text="")
    assert routed_experts([episode], 3, None) is None
    assert routed_experts([episode], 3, SHAPE).shape == (4, 2, 2) and (routed_experts([episode], 3, SHAPE) == -1).all()
    with pytest.raises(ValueError, match="different routing"):
        collate([a, _group(1, [5, 6], [[8]], 200)], pad_id=0)
    other = _group(2, [5, 6], [[8]], 200, np.zeros((2, 3, 2), dtype=np.int16))
    other.header.routing = RoutingShape(layers=3, top_k=2, num_experts=4)
    with pytest.raises(ValueError, match="different routing"):
        collate([a, other], pad_id=0)


def test_plans_and_models_that_cannot_be_replayed_are_refused(model_dir: Path, tokenizer, tmp_path: Path) -> None:
    model, _ = load_policy(model_dir, device="cpu")
    routers = find_routers(model)
    with pytest.raises(ValueError, match=r"needs \[batch, sequence, 2, 2\]"):
        routers.replay(torch.zeros(1, 3, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="outside 0..3"):
        routers.replay(torch.full((1, 3, 2, 2), 4))
    with pytest.raises(ValueError, match="some experts given and some -1"):
        routers.replay(torch.tensor([0, -1]).expand(1, 3, 2, 2))
    with pytest.raises(ValueError, match="plan of 3 positions for a router call over 4 tokens"):
        with routers.replay(torch.zeros(1, 3, 2, 2, dtype=torch.long)):
            model(input_ids=torch.tensor([[5, 6, 7, 8]]))
    # An MoE whose router rlbus does not know (Phi-MoE's sparsemixer) is refused, naming the router.
    with pytest.raises(ValueError, match="PhimoeTopKRouter"):
        build_checkpoint(tmp_path / "phimoe", tokenizer, arch="phimoe", hidden_size=32, layers=1, heads=4,
                         num_experts=4)


def test_engines_of_other_policies_record_no_routing(tokenizer, tmp_path: Path, caplog) -> None:
    dense_dir = build_checkpoint(tmp_path / "dense", tokenizer, arch="qwen3", hidden_size=32, layers=1, heads=4)
    assert find_routers(load_policy(dense_dir, device="cpu")[0]) is None
    # Phi-MoE, whose router rlbus cannot replay, generates all the same, without routing, and says so.
    config = AutoConfig.for_model("phimoe", vocab_size=len(tokenizer), hidden_size=32, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                                  num_local_experts=4, eos_token_id=tokenizer.eos_token_id)
    phimoe_dir = tmp_path / "phimoe"
    AutoModelForCausalLM.from_config(config).save_pretrained(phimoe_dir)
    tokenizer.save_pretrained(phimoe_dir)
    for model_dir in (dense_dir, phimoe_dir):
        engine = TorchEngine(model_dir, seed=0)
        assert engine.routing_shape is None
        (samples,) = asyncio.run(engine.generate_batch([tokenizer("3 plus")["input_ids"]], 2, SAMPLING))
        assert all(s.routing is None and s.prompt_routing is None and s.tokens for s in samples)
    assert "PhimoeTopKRouter" in caplog.text and "without recording the routing" in caplog.text


class _Echo:
    """An environment answering every turn with the same observation, keeping the first character of each turn."""

    name = "echo"
    max_turns = 3

    def observe(self, prompt: str, turn: str, answer: str):
        from producers.episodes import Observation

        return Observation(consumed=min(1, len(turn)), text=" is 7.")

    def score(self, prompt: str, completion: str, answer: str) -> float:
        return 1.0


def test_multi_turn_episodes_and_stages_keep_each_tokens_routing(model_dir: Path, tokenizer) -> None:
    """Every row of an episode's routing, its observations' included (from the next turn's pass over the
    context), is the expert choice at the position that predicted the token; a stage that keeps some samples
    keeps their rows."""
    from consumers.stages.base import select_samples
    from producers.episodes import run_episodes

    model, _ = load_policy(model_dir, device="cpu")
    engine = TorchEngine(model_dir, seed=3)
    prompt = tokenizer("3 plus 4")["input_ids"]
    (episodes,) = asyncio.run(run_episodes(engine, _Echo(), [("3 plus 4", "7", prompt)], 3, SAMPLING,
                                           max_context_tokens=200))
    assert any(0 in e.mask for e in episodes)  # observations between turns
    for episode in episodes:
        own = _own_choice(model, torch.tensor([prompt + episode.tokens]))[0]
        np.testing.assert_array_equal(episode.prompt_routing, own[: len(prompt) - 1].numpy())
        np.testing.assert_array_equal(episode.routing, own[len(prompt) - 1 : -1].numpy())
    routed = routed_experts(episodes, len(prompt), engine.routing_shape)
    group = _group(0, prompt, [e.tokens for e in episodes], engine.vocab_size, routed)
    kept = select_samples(group, [2, 0])
    alone = routed_experts([episodes[2], episodes[0]], len(prompt), engine.routing_shape)
    np.testing.assert_array_equal(kept.routed_experts, alone)
