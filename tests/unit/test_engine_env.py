"""The example's model round trip, TorchEngine sampling and weight swaps, tasks and datasets."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from broker.schema import SamplingParams
from producers.engine import GenerationResult, TorchEngine
from consumers.dataset import DatasetError, Row, read_rows
from producers.evaluate import greedy_accuracy
from producers.tasks import TaskError, load_task
from rlbus.config import load_config
from rlbus.examples.addition import AdditionTask, build_model, write_dataset
from trainer.model import load_policy
from trainer.loss import sequence_logprobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("engine") / "m", hidden_size=32, layers=1, heads=2, seed=3)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_base_model_round_trips_through_from_pretrained(tmp_path: Path, arch: str):
    out = build_model(tmp_path / arch, arch=arch, hidden_size=32, layers=1, heads=2, seed=1)
    model, tokenizer = load_policy(out)
    assert model.config.model_type == arch
    ids = tokenizer("12+7= 3")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 1 + len("12+7= 3")
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == "12+7= 3"
    again, _ = load_policy(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, again.state_dict()[name]), name


def _teacher_forced(model, prompt: list[int], result: GenerationResult, temperature: float) -> list[float]:
    ids = torch.tensor([prompt + result.tokens])
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, torch.ones_like(ids), temperature=temperature)[0]
    return lp[len(prompt) - 1 :].tolist()


def test_sampled_logprobs_match_a_teacher_forced_forward_pass(model_dir: Path):
    engine = TorchEngine(model_dir, seed=0)
    tok = engine.tokenizer
    prompts = [tok("12+7=")["input_ids"], tok("3+4=")["input_ids"]]  # different lengths: left padding
    sampling = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=6)
    out = asyncio.run(engine.generate_batch(prompts, 4, sampling))
    assert [len(group) for group in out] == [4, 4]
    for prompt, group in zip(prompts, out):
        for r in group:
            assert len(r.tokens) == len(r.logprobs) == len(r.versions) >= 1
            assert r.versions == [0] * len(r.tokens)
            assert r.finish_reason == ("stop" if r.tokens[-1] == tok.eos_token_id else "length")
            assert r.finish_reason == "stop" or len(r.tokens) == sampling.max_new_tokens
            assert r.text == tok.decode(r.tokens, skip_special_tokens=True)
            expected = _teacher_forced(engine.model, prompt, r, temperature=0.7)
            assert r.logprobs == pytest.approx(expected, abs=1e-4)


def test_greedy_is_deterministic_argmax(model_dir: Path):
    engine = TorchEngine(model_dir, seed=0)
    prompt = engine.tokenizer("5+5=")["input_ids"]
    greedy = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=5)
    a, b = asyncio.run(engine.generate(prompt, 2, greedy))
    assert a.tokens == b.tokens
    ids = list(prompt)
    for tok in a.tokens:
        with torch.no_grad():
            logits = engine.model(torch.tensor([ids])).logits[0, -1]
        assert tok == int(logits.argmax())
        ids.append(tok)


def test_weight_swap_mid_generation_stamps_later_tokens_with_the_new_version(model_dir: Path):
    engine = TorchEngine(model_dir, seed=1)
    prompt = engine.tokenizer("12+7=")["input_ids"]
    old_head = engine.model.lm_head.weight.detach().clone()
    # Only the output head changes, so the KV cache stays valid and the expected log-probs after
    # the swap are the old body's hidden states through the new head.
    new_state = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new_state["lm_head.weight"] = torch.randn_like(old_head) * 0.5
    swap_after_step = 1

    async def run() -> list[GenerationResult]:
        loop = asyncio.get_running_loop()

        def hook(step: int) -> None:  # runs in the decoding thread between two steps
            if step == swap_after_step:
                asyncio.run_coroutine_threadsafe(engine.load_weights(new_state, 7), loop).result()

        engine.step_hook = hook
        return await engine.generate(prompt, 8, SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6))

    results = asyncio.run(run())
    assert engine.version == 7
    assert any(len(r.tokens) > swap_after_step + 1 for r in results)
    for r in results:
        n_old = min(len(r.tokens), swap_after_step + 1)
        assert r.versions == [0] * n_old + [7] * (len(r.tokens) - n_old)
        ids = torch.tensor([prompt + r.tokens])
        with torch.no_grad():
            hidden = engine.model.model(ids).last_hidden_state[0, len(prompt) - 1 :]
        for t, (tok, lp, version) in enumerate(zip(r.tokens, r.logprobs, r.versions)):
            head = old_head if version == 0 else new_state["lm_head.weight"]
            expected = torch.log_softmax(hidden[t] @ head.T, dim=-1)[tok].item()
            assert lp == pytest.approx(expected, abs=1e-4)


def test_load_weights_refuses_a_mismatched_state_dict_without_changing_anything(model_dir: Path):
    engine = TorchEngine(model_dir, seed=0)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    bad = {k: v.clone() + 1 for k, v in before.items()}
    bad["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="wrong shape"):
        asyncio.run(engine.load_weights(bad, 1))
    partial = {k: v for k, v in bad.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="missing"):
        asyncio.run(engine.load_weights(partial, 1))
    assert engine.version == 0
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_the_addition_task_is_loaded_by_name_or_path_and_scores_exact_answers():
    task = load_task(load_config(None, ["run.task=addition"], environ={}).run.task)
    assert isinstance(task, AdditionTask) and task.name == "addition"
    assert isinstance(load_task("rlbus.examples.addition:AdditionTask"), AdditionTask)
    assert task.score("12+7=", "19", "19") == 1.0
    assert task.score("12+7=", " 19 ", "19") == 1.0
    assert task.score("12+7=", "91", "19") == 0.0
    assert task.score("12+7=", "19+", "19") == 0.0
    assert task.score("12+7=", "", "19") == 0.0
    with pytest.raises(TaskError, match="cannot import"):
        load_task("no_such_package.tasks:Chess")
    with pytest.raises(TaskError, match="has no attribute"):
        load_task("rlbus.examples.addition:Chess")
    with pytest.raises(TaskError, match="needs a 'name'"):
        load_task("rlbus.examples.addition:AdditionConfig")


def test_addition_dataset_split_is_disjoint_and_complete(tmp_path: Path):
    train_path, heldout_path = write_dataset(tmp_path, seed=5, max_operand=12, n_heldout=30)
    train, heldout = read_rows(train_path), read_rows(heldout_path)
    assert len(heldout) == 30 and len(train) == 12 * 12 - 30
    assert not {r.prompt for r in train} & {r.prompt for r in heldout}
    assert len({r.key for r in train + heldout}) == 144
    for r in train + heldout:
        a, b = r.prompt.rstrip("=").split("+")
        assert int(a) + int(b) == int(r.answer)
    again, _ = write_dataset(tmp_path / "again", seed=5, max_operand=12, n_heldout=30)
    assert read_rows(again) == train  # seeded


def test_the_dataset_reader_names_the_bad_line(tmp_path: Path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt_id": "a", "prompt": "1+1=", "answer": "2"}) + "\n{oops\n")
    with pytest.raises(DatasetError, match=r"d.jsonl:2: not valid JSON"):
        read_rows(path)
    path.write_text(json.dumps({"prompt_id": "a", "prompt": "1+1="}) + "\n")
    with pytest.raises(DatasetError, match=r"d.jsonl:1: field 'answer' \(data.fields.answer\) missing"):
        read_rows(path)
    path.write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n\n" + json.dumps({"prompt": "2+2=", "answer": "4"}))
    assert read_rows(path) == [Row("line1", "1+1=", "2"), Row("line3", "2+2=", "4")]  # numbers are text, keys by line
    with pytest.raises(DatasetError, match="does not exist"):
        read_rows(tmp_path / "none.jsonl")


def test_greedy_accuracy_counts_exact_matches(model_dir: Path):
    engine = TorchEngine(model_dir, seed=0)
    rows = [Row(str(i), f"{i}+1=", str(i + 1)) for i in range(5)]
    greedy = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=3)
    outs = asyncio.run(engine.generate_batch([engine.tokenizer(r.prompt)["input_ids"] for r in rows], 1, greedy))
    for i, o in enumerate(outs[:2]):  # make the model's own (greedy, deterministic) answer correct
        rows[i] = Row(rows[i].key, rows[i].prompt, o[0].text.strip())
    expected = sum(o[0].text.strip() == r.answer for o, r in zip(outs, rows)) / len(rows)
    acc = asyncio.run(greedy_accuracy(engine, AdditionTask(), rows, max_new_tokens=3, batch_size=2))
    assert acc == pytest.approx(expected) and acc >= 0.4
