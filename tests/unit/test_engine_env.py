"""The example's model round trip, tasks and datasets (the engines' contract: tests/unit/test_engine_contract.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from broker.schema import SamplingParams
from consumers.dataset import DatasetError, Row, read_rows
from producers.engines.torch_engine import TorchEngine
from producers.evaluate import greedy_accuracy
from producers.tasks import TaskError, load_task
from rlbus.config import load_config
from rlbus.examples.addition import AdditionTask, build_model, write_dataset
from trainer.model import load_policy


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
