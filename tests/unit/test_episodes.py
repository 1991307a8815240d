"""Multi-turn episodes: the trainer's loss blind to what the environment wrote, and the tool
environment. Episodes on both engines (turns cut where the environment says, observations masked,
each turn stamped with its version) are part of tests/unit/test_engine_contract.py."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader
from producers.engines.torch_engine import TorchEngine
from producers.episodes import Observation, run_episodes
from producers.tasks.tool import ToolTask, calculate
from producers.worker import pack_samples
from rlbus.examples.addition import build_model
from trainer.batch import collate
from trainer.config import TrainerConfig
from trainer.model import load_policy
from trainer.step import train_step

SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6)


class Echo:
    """An environment that answers every turn with a fixed observation, keeping ``keep`` characters."""

    name = "echo"
    max_turns = 3

    def __init__(self, keep: int) -> None:
        self.keep, self.turns = keep, []

    def observe(self, prompt: str, turn: str, answer: str) -> Observation | None:
        self.turns.append(turn)
        return Observation(consumed=min(self.keep, len(turn)), text="=1")

    def score(self, prompt: str, completion: str, answer: str) -> float:
        return 1.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("ep") / "m", hidden_size=32, layers=1, heads=2, seed=5)


def test_the_trainer_learns_nothing_from_observation_tokens(model_dir: Path) -> None:
    model, tokenizer = load_policy(model_dir)
    engine = TorchEngine(model_dir, seed=1)
    prompt = tokenizer("3+4=")["input_ids"]
    (episodes,) = asyncio.run(run_episodes(engine, Echo(keep=1), [("3+4=", "7", prompt)], 3, SAMPLING,
                                           max_context_tokens=64))
    columns = pack_samples(episodes)
    assert columns["loss_mask"].min() == 0 and columns["loss_mask"].max() == 1

    def group(columns: dict) -> TrajectoryGroup:
        header = TrajectoryHeader(
            run="r", policy="main", group_id="g", prompt_id="p", task="echo", worker_id="w", sampling=SAMPLING,
            rewards=[0.0, 1.0, 1.0], finish_reasons=[e.finish_reason for e in episodes], min_version=0,
            max_version=0, vocab_size=len(tokenizer), created_at=time.time())
        return TrajectoryGroup(header=header, prompt_tokens=np.asarray(prompt, np.int32), **columns)

    # The same episodes with other observation log-probs and other observation tokens: the step
    # must move the weights exactly as before, on the plain and on the shared-prefix forward.
    mask = columns["loss_mask"] == 1
    altered = dict(columns, behaviour_logprobs=np.where(mask, columns["behaviour_logprobs"], -9.0).astype(np.float32))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    for shared in (True, False):
        config = TrainerConfig(lr=1e-2, shared_prefix=shared)
        after = []
        for cols in (columns, altered):
            model.load_state_dict(start)
            optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
            result = train_step(model, optimizer, [group(cols)], config, pad_id=tokenizer.pad_token_id, temperature=1.0)
            assert result.samples == 3
            after.append({k: v.clone() for k, v in model.state_dict().items()})
        assert any(not torch.equal(after[0][k], start[k]) for k in start)  # the step did learn
        assert all(torch.equal(after[0][k], after[1][k]) for k in start), f"shared_prefix={shared}"
    batch = collate([group(columns)], pad_id=tokenizer.pad_token_id)
    assert int(batch.completion_mask.sum()) == int(columns["loss_mask"].sum())  # only generated tokens count


def test_the_tool_environment_answers_calls_and_scores_the_final_answer(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"id": 1, "text": "Mount Everest is 8849 metres high."}\n'
                      '{"id": 2, "text": "The Nile is the longest river."}\n')
    task = ToolTask(corpus=str(corpus), max_turns=3)
    turn = 'Let me look. <tool_call>{"name": "search", "arguments": {"query": "Everest height"}}</tool_call> I think'
    seen = task.observe("How high is Everest?", turn, "8849")
    assert seen is not None and turn[: seen.consumed].endswith("</tool_call>") and "8849 metres" in seen.text
    calc = task.observe("", '<tool_call>{"name": "calculator", "arguments": {"expression": "(2+3)*4"}}</tool_call>', "")
    assert calc is not None and "<tool_response>20</tool_response>" in calc.text
    for bad, error in (('<tool_call>not json</tool_call>', "a call is JSON"),
                       ('<tool_call>{"name": "shell", "arguments": {}}</tool_call>', "unknown tool 'shell'"),
                       ('<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(1)"}}</tool_call>',
                        "only numbers")):
        answer = task.observe("", bad, "")
        assert answer is not None and error in answer.text
    assert task.observe("", "<answer>8849</answer>", "8849") is None  # no call: the episode ends
    assert task.score("", f"{turn}\n<tool_response>...</tool_response>\n<answer> 8,849 </answer>", "8849") == 1.0
    assert task.score("", "<answer>8848</answer>", "8849") == 0.0 and task.score("", "8849", "8849") == 0.0
    assert calculate("2**10") == 1024
    with pytest.raises(ValueError, match="exponent"):
        calculate("2**100000")


def test_a_turn_keeps_the_stop_token_that_ended_it_and_loses_what_came_past_its_end(model_dir: Path) -> None:
    from producers.engines import GenerationResult
    from producers.episodes import _Episode, _take_turn

    _, tok = load_policy(model_dir)
    ids = tok("12", add_special_tokens=False)["input_ids"]
    stopped = GenerationResult(tokens=ids + [tok.eos_token_id], logprobs=[-0.5] * (len(ids) + 1),
                               versions=[3] * (len(ids) + 1), finish_reason="stop", text="12")
    cases = [(Observation(consumed=2, text="=1"), len(ids) + 1, True),  # the whole text: its stop token too
             (None, len(ids) + 1, False),
             (Observation(consumed=1, text="", end=True), 1, False)]  # ends inside the turn: the rest is dropped
    for answer, kept, running in cases:
        episode = _Episode([1], None)
        _take_turn(tok, episode, stopped, answer, last=False, sampling=SAMPLING, max_context_tokens=64,
                   engine_version=3)
        assert episode.turns == [(0, kept)] and episode.tokens[:kept] == stopped.tokens[:kept]
        assert episode.running is running and episode.mask[:kept] == [1] * kept
        # Where the environment cut the turn, the turn ended there: "stop", whatever the engine said.
        assert episode.finish == "stop"
