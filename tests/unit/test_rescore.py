"""Re-scoring groups at the intake: the run's task, on completions a real engine sampled, decoded with
the policy's own tokenizer."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from broker.schema import PromptRecord, SamplingParams, TrajectoryGroup, TrajectoryHeader
from consumers.dataset import Row
from consumers.rescore import Rescorer
from producers.engines.torch_engine import TorchEngine
from producers.tasks import AnswerError
from producers.worker import pack_samples
from producers.workflows import PolicyRuntime
from producers.workflows.single import SingleWorkflow
from rlbus.examples.addition import AdditionTask

SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=3)
ROWS = [Row(key=f"k{a}{b}", prompt=f"{a}+{b}=", answer=str(a + b)) for a in range(4) for b in range(4)]


class Recording(AdditionTask):
    """The addition task, noting every (prompt, completion, answer) it scores."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    def score(self, prompt: str, completion: str, answer: str) -> float:
        self.seen.append((prompt, completion, answer))
        return super().score(prompt, completion, answer)


@pytest.fixture(scope="module")
def honest(tiny_model_dir: Path) -> tuple[TorchEngine, list[TrajectoryGroup], Recording]:
    """Groups as a worker makes them: the single workflow on a real engine, scored by the task (which
    notes what the worker scored)."""
    engine, task = TorchEngine(tiny_model_dir, seed=3, version=0), Recording()
    prompts = [PromptRecord(run="r", policy="main", prompt_id=f"p{i}", prompt_key=row.key, task="addition",
                            prompt=row.prompt, answer=row.answer, group_size=6, dispatch_version=0)
               for i, row in enumerate(ROWS[:6])]
    out = asyncio.run(SingleWorkflow().run(prompts, {"policy": PolicyRuntime("main", engine, SAMPLING)}, task))
    groups = []
    for prompt, (produced,) in zip(prompts, out):
        header = TrajectoryHeader(
            run="r", policy="main", group_id=f"{prompt.prompt_id}/main", prompt_id=prompt.prompt_id,
            prompt_key=prompt.prompt_key, task="addition", worker_id="w", sampling=SAMPLING, rewards=produced.rewards,
            finish_reasons=[r.finish_reason for r in produced.results], min_version=0, max_version=0, vocab_size=64,
            created_at=time.time())
        groups.append(TrajectoryGroup(header=header, prompt_tokens=np.asarray(produced.prompt_tokens, np.int32),
                                      **pack_samples(produced.results)))
    return engine, groups, task


def _with(group: TrajectoryGroup, **header) -> TrajectoryGroup:
    return TrajectoryGroup(header=group.header.model_copy(update=header), prompt_tokens=group.prompt_tokens,
                           completion_tokens=group.completion_tokens, completion_offsets=group.completion_offsets,
                           behaviour_logprobs=group.behaviour_logprobs, token_versions=group.token_versions,
                           loss_mask=group.loss_mask)


def _answering(engine: TorchEngine, group: TrajectoryGroup, texts: list[str]) -> TrajectoryGroup:
    """``group`` with its completions replaced by the tokens of ``texts``."""
    tokens = [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    flat = np.asarray([t for ts in tokens for t in ts], np.int32)
    return TrajectoryGroup(header=group.header, prompt_tokens=group.prompt_tokens, completion_tokens=flat,
                           completion_offsets=np.cumsum([0, *map(len, tokens)]).astype(np.int32),
                           behaviour_logprobs=np.full(len(flat), -1.0, np.float32),
                           token_versions=np.zeros(len(flat), np.int32))


def test_the_checker_sees_what_the_worker_scored(honest) -> None:
    engine, groups, worker_task = honest
    again = Recording()
    verdicts = [Rescorer(again, ROWS, engine.tokenizer).check(g) for g in groups]
    assert all(v.agrees for v in verdicts), [v.reason for v in verdicts]
    assert [v.rewards for v in verdicts] == [g.header.rewards for g in groups]
    assert again.seen == worker_task.seen and len(again.seen) == 36  # the same texts, in the same order


def test_claimed_rewards_the_checker_does_not_give_disagree(honest) -> None:
    engine, groups, _ = honest
    rescorer = Rescorer(AdditionTask(), ROWS, engine.tokenizer)
    right = _answering(engine, groups[0], [ROWS[0].answer, "9", ROWS[0].answer])
    verdict = rescorer.check(_with(right, rewards=[1.0, 1.0, 1.0]))
    assert not verdict.agrees and not verdict.unscored
    assert verdict.rewards == [1.0, 0.0, 1.0]
    assert verdict.reason == "claimed rewards [1, 1, 1], the task's checker gives [1, 0, 1]"
    assert rescorer.check(_with(right, rewards=[1.0, 0.0, 1.0])).agrees
    assert rescorer.check(_with(right, rewards=[1.0, 0.0, 1.0 - 1e-9])).agrees  # within the tolerance
    assert not rescorer.check(_with(right, rewards=[1.0, 0.0])).agrees  # a reward missing


@pytest.mark.parametrize("change, why", [
    (lambda g: _with(g, task="code"), "task 'code'"),
    (lambda g: _with(g, prompt_key="nope"), "not a row"),
    (lambda g: _with(g, prompt_key=None), "not a row"),
    (lambda g: _with(g, subgroups=list(range(len(g.header.rewards)))), "subgroups"),
    (lambda g: _with(g, prompt_key=ROWS[-1].key), "prompt tokens are not those of dataset row"),
])
def test_groups_that_cannot_be_rescored_say_why(honest, change, why) -> None:
    engine, groups, _ = honest
    verdict = Rescorer(AdditionTask(), ROWS, engine.tokenizer).check(change(groups[1]))
    assert verdict.unscored and why in verdict.reason


def test_masked_tokens_and_a_failing_checker_leave_a_group_unscored(honest) -> None:
    engine, groups, _ = honest
    group = groups[2]
    masked = _with(group)
    masked.loss_mask = np.ones(len(group.completion_tokens), np.uint8)
    masked.loss_mask[0] = 0
    assert "masked tokens" in Rescorer(AdditionTask(), ROWS, engine.tokenizer).check(masked).reason

    class Fragile(AdditionTask):
        def score(self, prompt, completion, answer):
            raise ZeroDivisionError("the checker's own bug")

    class NoAnswer(AdditionTask):
        def score(self, prompt, completion, answer):
            raise AnswerError("answer is not JSON")

    assert "ZeroDivisionError" in Rescorer(Fragile(), ROWS, engine.tokenizer).check(group).reason
    assert "answer the task cannot use" in Rescorer(NoAnswer(), ROWS, engine.tokenizer).check(group).reason


def test_rows_sharing_a_key_agree_with_either(honest) -> None:
    engine, groups, _ = honest
    row = ROWS[0]
    twin = Row(key=row.key, prompt=row.prompt, answer="999")
    group = _answering(engine, groups[0], ["999", row.answer])
    group = _with(group, rewards=[1.0, 0.0])
    assert Rescorer(AdditionTask(), [row, twin], engine.tokenizer).check(group).agrees
    assert not Rescorer(AdditionTask(), [row], engine.tokenizer).check(group).agrees


def test_a_fraction_rescored_is_the_same_groups_each_time(honest) -> None:
    engine, _, _ = honest
    ids = [f"p{i}/main" for i in range(4000)]
    quarter = Rescorer(AdditionTask(), ROWS, engine.tokenizer, fraction=0.25)
    picked = [i for i in ids if quarter.sampled(i)]
    assert 850 < len(picked) < 1150
    assert picked == [i for i in ids if Rescorer(AdditionTask(), ROWS, engine.tokenizer, fraction=0.25).sampled(i)]
    assert all(Rescorer(AdditionTask(), ROWS, engine.tokenizer).sampled(i) for i in ids)


def test_the_trainer_rescores_policies_scored_by_the_task_and_says_which_it_does_not(tmp_path, caplog) -> None:
    from rlbus.config import load_config
    from rlbus.roles import _rescore_with

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+2=", "answer": 3, "prompt_id": "a"}\n')
    root = Path(__file__).resolve().parents[2] / "configs"
    single = load_config(root / "ci.toml", ["intake.rescore=reject"], environ={})
    with pytest.raises(SystemExit, match="--dataset"):
        _rescore_with(single, single.policy().name, None)
    task, rows = _rescore_with(single, single.policy().name, data)
    assert task.name == "addition" and rows == [Row(key="a", prompt="1+2=", answer="3")]
    assert _rescore_with(load_config(root / "ci.toml", [], environ={}), "main", None) is None  # off: nothing needed

    pair = load_config(root / "solver_verifier.toml", ["intake.rescore=count"], environ={})
    assert _rescore_with(pair, "solver", data) is not None
    with caplog.at_level("WARNING"):
        assert _rescore_with(pair, "verifier", data) is None
    assert "policy verifier is not re-scored (roles ['solve/verifier'] are not scored by the task)" in caplog.text
