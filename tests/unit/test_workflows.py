"""Workflows on real (tiny) engines: what each policy's group holds, and how roles are judged."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from broker.codec import decode_group, encode_group
from broker.schema import PromptRecord, SamplingParams, TrajectoryGroup, TrajectoryHeader
from producers.config import WorkflowSpec
from producers.engines.torch_engine import TorchEngine
from producers.worker import pack_samples
from producers.workflows import PolicyRuntime, WorkflowError, load_workflow
from producers.workflows.solver_verifier import SolverVerifierWorkflow, VerdictTask
from rlbus.examples.addition import AdditionTask

SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=3)
VERDICT = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=1)


def _prompt(i: int, a: int, b: int) -> PromptRecord:
    return PromptRecord(run="r", policy="solve", prompt_id=f"p{i}", task="addition", prompt=f"{a}+{b}=",
                        answer=str(a + b), group_size=6, dispatch_version=3)


def _policies(model_dir: Path) -> dict[str, PolicyRuntime]:
    return {"solver": PolicyRuntime("solver", TorchEngine(model_dir, seed=1, version=3), SAMPLING),
            "verifier": PolicyRuntime("verifier", TorchEngine(model_dir, seed=2, version=7), VERDICT)}


def test_solver_verifier_emits_one_group_per_policy(tiny_model_dir: Path) -> None:
    flow = SolverVerifierWorkflow(template="{prompt}{completion}=", accept="1", reject="0", balanced=False)
    policies = _policies(tiny_model_dir)
    tokenizer = policies["verifier"].engine.tokenizer
    prompts = [_prompt(0, 12, 7), _prompt(1, 30, 4)]
    out = asyncio.run(flow.run(prompts, policies, AdditionTask()))
    for prompt, groups in zip(prompts, out):
        solver, verifier = groups
        assert (solver.policy, verifier.policy) == ("solver", "verifier")
        assert len(solver.results) == len(verifier.results) == 6
        assert solver.rewards == [AdditionTask().score(prompt.prompt, r.text, prompt.answer) for r in solver.results]
        assert all(v == 3 for r in solver.results for v in r.versions)
        assert verifier.provenance == {"solver": [3, 3]}
        for answer, sample, reward, correct in zip(solver.results, verifier.results, verifier.rewards, solver.rewards):
            mask = np.asarray(sample.mask)
            tokens = np.asarray(sample.tokens)
            # The shared prompt and the masked rest are exactly the verifier's prompt for this answer.
            expected = tokenizer(f"{prompt.prompt}{answer.text.strip()}=")["input_ids"]
            assert verifier.prompt_tokens + tokens[mask == 0].tolist() == expected
            assert mask.tolist() == sorted(mask.tolist()) and mask.sum() == 1  # then the one-token verdict, trained on
            assert all(v == 7 for v in sample.versions)  # the verifier's own version, masked tokens included
            assert all(lp == 0.0 for lp, m in zip(sample.logprobs, mask) if m == 0)
            verdict = flow.verdicts.verdict(sample.text)
            assert reward == (1.0 if verdict == (correct >= 1.0) else 0.0)


def test_several_verdicts_per_answer_form_one_subgroup_per_answer(tiny_model_dir: Path) -> None:
    flow = SolverVerifierWorkflow(template="{prompt}{completion}=", accept="1", reject="0", balanced=False,
                                  verdicts=3)
    policies = _policies(tiny_model_dir)
    tokenizer = policies["verifier"].engine.tokenizer
    prompt = _prompt(0, 12, 7)
    (solver, verifier), = asyncio.run(flow.run([prompt], policies, AdditionTask()))
    assert len(solver.results) == 6 and len(verifier.results) == 18
    assert verifier.subgroups == [k for k in range(6) for _ in range(3)]
    for i, (sample, reward) in enumerate(zip(verifier.results, verifier.rewards)):
        answer, correct = solver.results[i // 3], solver.rewards[i // 3]
        mask = np.asarray(sample.mask)
        expected = tokenizer(f"{prompt.prompt}{answer.text.strip()}=")["input_ids"]
        assert verifier.prompt_tokens + np.asarray(sample.tokens)[mask == 0].tolist() == expected
        assert reward == (1.0 if flow.verdicts.verdict(sample.text) == (correct >= 1.0) else 0.0)
    # One verdict per answer: the G verdicts are compared with each other, as before.
    (_, single), = asyncio.run(flow.__class__(template="{prompt}{completion}=", accept="1", reject="0")
                               .run([prompt], policies, AdditionTask()))
    assert single.subgroups is None and len(single.results) == 6
    with pytest.raises(ValueError, match="verdicts"):
        SolverVerifierWorkflow(verdicts=0)


def test_balanced_verifier_rewards_pay_a_constant_verdict_the_same_whatever_the_majority() -> None:
    correct = [True, False, False, False, True, False]  # 2 right answers, 4 wrong ones
    weights = SolverVerifierWorkflow._class_weights(correct)
    assert weights == {True: 1.0, False: 0.5}
    always_reject = sum(weights[c] for c in correct if not c)
    always_accept = sum(weights[c] for c in correct if c)
    assert always_reject == always_accept == 2.0 and sum(weights[c] for c in correct) == 4.0  # judging pays
    assert SolverVerifierWorkflow._class_weights([True, True]) == {True: 1.0, False: 1.0}  # one class: nothing to balance


def test_a_verifier_group_survives_the_wire(tiny_model_dir: Path) -> None:
    flow = SolverVerifierWorkflow(template="{prompt}{completion}=", accept="1", reject="0", verdicts=2)
    (_, verifier), = asyncio.run(flow.run([_prompt(0, 1, 2)], _policies(tiny_model_dir), AdditionTask()))
    arrays = pack_samples(verifier.results)
    header = TrajectoryHeader(
        run="r", policy="verifier", group_id="p0/verifier", prompt_id="p0", task="addition", worker_id="w",
        sampling=VERDICT, rewards=verifier.rewards, finish_reasons=[r.finish_reason for r in verifier.results],
        min_version=7, max_version=7, vocab_size=64, created_at=time.time(), provenance=verifier.provenance,
        subgroups=verifier.subgroups)
    group = TrajectoryGroup(header=header, prompt_tokens=np.asarray(verifier.prompt_tokens, np.int32), **arrays)
    back = decode_group(encode_group(group))
    assert back.header.provenance == {"solver": [3, 3]}
    assert back.header.subgroups == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert back.loss_mask.tolist() == arrays["loss_mask"].tolist()


def test_the_verifiers_heldout_set_is_balanced_and_labelled_by_the_checker(tiny_model_dir: Path) -> None:
    from consumers.dataset import Row

    flow = SolverVerifierWorkflow(template="{prompt}{completion}=", accept="1", reject="0", heldout_answers=3)
    rows = [Row(key=f"k{a}", prompt=f"{a}+1=", answer=str(a + 1)) for a in range(12)]
    judged = asyncio.run(flow.role_rows("verifier", rows, _policies(tiny_model_dir), AdditionTask(), seed=0))
    labels = [r["answer"] for r in judged]
    assert labels.count("1") == labels.count("0") >= 12  # every reference answer is a correct candidate
    for r in judged:
        question, candidate = r["prompt"][:-1].split("=", 1)
        truth = str(int(question.split("+")[0]) + 1)
        assert (candidate == truth) == (r["answer"] == "1")
    assert asyncio.run(flow.role_rows("solver", rows, {}, AdditionTask(), seed=0))[0] == \
        {"prompt_id": "k0", "prompt": "0+1=", "answer": "1"}
    judge = flow.judge("verifier", AdditionTask())
    assert judge.score("", " 1", "1") == 1.0 and judge.score("", "0", "1") == 0.0 and judge.score("", "x", "0") == 0.0


def test_verdicts_and_bad_parameters() -> None:
    task = VerdictTask("yes", "no")
    assert task.verdict(" Yes, it is") is True and task.verdict("no.") is False and task.verdict("maybe") is None
    assert task.verdict("It is 12, not 13... no wait, yes") is True  # the last verdict counts: it may reason first
    assert task.score("", "I get 12. no", "12 no") == 1.0 and task.score("", "yes", "no") == 0.0
    assert task.score("", "maybe", "maybe") == 0.0  # no verdict is never right
    assert task.verdict("I do not know") is None  # 'no' inside 'not' or 'know' is no verdict
    assert VerdictTask("1", "0").verdict("70") is None and VerdictTask("1", "0").verdict(" 1") is True
    assert VerdictTask("+", "-").verdict("70-") is False
    with pytest.raises(ValueError, match="neither part of the other"):
        SolverVerifierWorkflow(accept="y", reject="yes")
    with pytest.raises(ValueError, match="needs a {completion} field"):
        SolverVerifierWorkflow(template="{prompt}")
    with pytest.raises(ValueError, match="takes only"):
        SolverVerifierWorkflow(template="{prompt}{completion}{other}")


def test_workflows_load_by_name_or_path_and_check_their_roles() -> None:
    spec = WorkflowSpec(name="solve", type="solver_verifier", roles={"solver": "a", "verifier": "b"})
    assert isinstance(load_workflow(spec), SolverVerifierWorkflow)
    path = WorkflowSpec(name="s", type="producers.workflows.single:SingleWorkflow", roles={"policy": "a"})
    assert load_workflow(path).roles == ("policy",)
    with pytest.raises(WorkflowError, match="has the roles \\['solver', 'verifier'\\]"):
        load_workflow(WorkflowSpec(name="solve", type="solver_verifier", roles={"solver": "a"}))
    with pytest.raises(WorkflowError, match="is unknown"):
        load_workflow(WorkflowSpec(name="x", type="nonsense", roles={"policy": "a"}))
    with pytest.raises(WorkflowError, match="cannot load"):
        load_workflow(WorkflowSpec(name="x", type="no.such.module:Flow", roles={"policy": "a"}))
    with pytest.raises(WorkflowError, match="with params"):
        load_workflow(WorkflowSpec(name="x", type="solver_verifier", roles={"solver": "a", "verifier": "b"},
                                   params={"accept": "y", "reject": "yes"}))
