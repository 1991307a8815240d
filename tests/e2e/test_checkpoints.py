"""`rlbus run` on checkpoints and tasks of a user's own: an architecture the default config does not
use, a byte-level BPE tokenizer with a chat template, saved with ``save_pretrained``; each built-in
task through the real broker and store. The store's last version is the trainer's weights, bit for
bit, and loads with ``from_pretrained``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]
STEPS = 3


def _math_rows(n: int, offset: int = 0) -> list[dict]:
    return [{"prompt_id": f"m{i}", "prompt": f"What is {i} plus {i + offset}?", "answer": 2 * i + offset}
            for i in range(n)]


def _code_rows(n: int) -> list[dict]:
    return [{"prompt": f"Write a Python function f(x) that returns x + {i}.",
             "answer": {"asserts": [f"assert f(1) == {1 + i}", f"assert f(-2) == {i - 2}"]}} for i in range(n)]


def _tool_rows(n: int) -> list[dict]:
    return [{"prompt": f"Use the calculator: what is {i} times 7? Answer in <answer></answer>.", "answer": 7 * i}
            for i in range(n)]


TASKS = {
    # task: (architecture, rows(train), rows(held out))
    "math": ("qwen3", _math_rows(40), _math_rows(8, offset=3)),
    "code": ("mistral", _code_rows(40), _code_rows(8)),
    "tool": ("qwen3", _tool_rows(40), _tool_rows(8)),
}


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _checkpoint(out: Path, arch: str, rows: list[dict]) -> Path:
    from rlbus.examples.scratch import build_checkpoint, train_bpe_tokenizer

    texts = [r["prompt"] + " " + json.dumps(r["answer"]) for r in rows] + ["```python\ndef f(x):\n    return x\n```"]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=400, chat_template=True)
    return build_checkpoint(out, tokenizer, arch=arch, hidden_size=32, layers=1, heads=4, kv_heads=2, seed=1)


def summary_ok(run_dir: Path) -> bool:
    return (run_dir / "summary.json").is_file()


def _rewarded(run_dir: Path) -> bool:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return any(r["reward_mean"] > 0 for r in rows)


def _run(tmp: Path, *sets: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "rlbus.cli", "run", str(ROOT / "configs/ci.toml"), "--set", f"local.dir={tmp / 'runs'}"]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_a_checkpoint_of_another_architecture_trains_on_a_builtin_task(task: str, tmp_path: Path) -> None:
    arch, train, heldout = TASKS[task]
    model_dir = _checkpoint(tmp_path / "ckpt", arch, train)
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == arch
    done = _run(
        tmp_path, f"model.path={model_dir}", f"run.task={task}", f"data.path={_write(tmp_path / 'train.jsonl', train)}",
        f"data.heldout_path={_write(tmp_path / 'heldout.jsonl', heldout)}", "data.fields.chat=true",
        f"trainer.max_steps={STEPS}", f"trainer.checkpoint_every={STEPS}", "trainer.groups_per_step=4",
        "sampling.group_size=2", "sampling.max_new_tokens=12", "local.workers=1", "weights.publish_dtype=float32",
        *(['run.task_params={"max_turns": 2}'] if task == "tool" else []),
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    # ci.toml's dynamic sampling drops the groups of a model that never gets a reward; the trainer
    # goes on with them once it dropped max_stage_drops_per_step batches' worth, and says so.
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    assert summary_ok(run_dir) and ("no signal" in trainer_log or _rewarded(run_dir))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions_published"] == STEPS + 1 and summary["groups_trained"] == 4 * STEPS
    assert 0.0 <= summary["reward_start"] <= 1.0 and 0.0 <= summary["reward_end"] <= 1.0

    from transformers import AutoModelForCausalLM

    from trainer.checkpoint import load_latest_checkpoint
    from weightstore.config import build_store, store_config_from_url
    from weightstore.modelfiles import prepare_local_model

    checkpoint = load_latest_checkpoint(run_dir / "checkpoints" / "main")
    assert checkpoint.version == STEPS
    restored = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    checkpoint.restore(restored)
    trained = restored.state_dict()
    local, _, version = prepare_local_model(build_store(store_config_from_url(str(run_dir / "store"))), "main",
                                            tmp_path / "fetched", timeout_s=30)
    assert version == STEPS
    model = AutoModelForCausalLM.from_pretrained(local, local_files_only=True, dtype=torch.float32)
    assert type(model).__name__.lower().startswith(arch)
    loaded = model.state_dict()
    assert set(trained) <= set(loaded)
    for name, tensor in trained.items():
        assert torch.equal(loaded[name], tensor), name


def test_bad_task_checkpoint_or_data_fail_at_start_naming_the_problem(tmp_path: Path) -> None:
    train = _write(tmp_path / "train.jsonl", [{"question": "1+1?", "answer": "2"}])
    cases = [
        (["run.task=chess"], "run.task = 'chess' is unknown"),
        (["run.task=reasoning_gym:no_such_dataset"], "no_such_dataset"),
        ([f"model.path={tmp_path}"], "has no config.json"),
        ([f"data.path={train}"], "field 'prompt' (data.fields.prompt) missing"),
    ]
    for sets, message in cases:
        done = _run(tmp_path, *sets)
        assert done.returncode == 2, (sets, done.stdout[-2000:], done.stderr[-2000:])
        assert message in done.stderr, (sets, done.stderr[-2000:])
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())  # nothing was started
