"""In-process GRPO/DAPO recipe on the addition task: a warm-up, then RL lifts held-out accuracy.

Everything the distributed run does, on one thread and without Kafka or S3: build a tiny model
from scratch, supervised warm-up to a low accuracy on train prompts, then repeat
``TorchEngine.generate_batch -> AdditionTask.score -> trainer.step.train_step`` (the trainer's own step) and hand
the new weights to the engine after every step. Held-out greedy accuracy is printed as it goes;
the last line is one JSON object.

    .venv/bin/python -m benchmarks.rl_recipe --seed 0
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import tempfile
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
import transformers
import typer

from broker.schema import TrajectoryGroup, TrajectoryHeader
from consumers.dataset import Row, read_rows
from producers.config import SamplingConfig
from producers.engines import GenerationResult
from producers.engines.torch_engine import TorchEngine
from producers.evaluate import greedy_accuracy
from rlbus.examples.addition import AdditionConfig, AdditionTask, build_model, write_dataset
from trainer.config import TrainerConfig
from trainer.model import load_policy
from trainer.step import train_step
from trainer.warmup import supervised_warmup

logger = logging.getLogger("rl_recipe")


def to_group(row: Row, prompt: list[int], results: list[GenerationResult], rewards: list[float],
             sampling: SamplingConfig, vocab_size: int, created_at: float) -> TrajectoryGroup:
    """The trajectory-group record a rollout worker would publish for one prompt."""
    versions = [v for r in results for v in r.versions]
    header = TrajectoryHeader(
        run="recipe", policy="main", group_id=f"{row.key}-{created_at}", prompt_id=row.key,
        task="addition", worker_id="inproc", sampling=sampling.params(), rewards=rewards,
        finish_reasons=[r.finish_reason for r in results], min_version=min(versions),
        max_version=max(versions), vocab_size=vocab_size, created_at=created_at,
    )
    return TrajectoryGroup(
        header=header,
        prompt_tokens=np.asarray(prompt, dtype=np.int32),
        completion_tokens=np.asarray([t for r in results for t in r.tokens], dtype=np.int32),
        completion_offsets=np.cumsum([0] + [len(r.tokens) for r in results]).astype(np.int32),
        behaviour_logprobs=np.asarray([lp for r in results for lp in r.logprobs], dtype=np.float32),
        token_versions=np.asarray(versions, dtype=np.int32),
    )


async def rl_loop(model_dir: Path, train: list[Row], heldout: list[Row], cfg: TrainerConfig,
                  sampling: SamplingConfig, eval_every: int, time_budget_s: float, target: float) -> dict:
    task = AdditionTask()
    engine = TorchEngine(model_dir, seed=cfg.seed)
    policy, tokenizer = load_policy(model_dir)
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    max_eval_tokens = max(len(r.answer) for r in heldout) + 1
    eval_s = 0.0

    async def evaluate() -> float:
        nonlocal eval_s
        t0 = time.perf_counter()
        acc = await greedy_accuracy(engine, task, heldout, max_eval_tokens, batch_size=512)
        eval_s += time.perf_counter() - t0
        return acc

    reward_start = await evaluate()
    print(f"step 0: held-out greedy accuracy {reward_start:.3f}", flush=True)
    started = time.perf_counter()
    history, steps_to_target, step, acc = [(0, reward_start)], None, 0, reward_start
    for step in range(1, cfg.max_steps + 1):
        rows = rng.sample(train, cfg.groups_per_step)
        prompts = [tokenizer(r.prompt)["input_ids"] for r in rows]
        created = time.time()
        outs = await engine.generate_batch(prompts, sampling.group_size, sampling.params())
        groups = []
        for row, prompt, results in zip(rows, prompts, outs):
            rewards = [task.score(row.prompt, r.text, row.answer) for r in results]
            groups.append(to_group(row, prompt, results, rewards, sampling, engine.vocab_size, created))
        for param_group in optimizer.param_groups:
            param_group["lr"] = cfg.lr * cfg.lr_multiplier(step - 1)
        result = train_step(policy, optimizer, groups, cfg, pad_id=tokenizer.pad_token_id,
                            temperature=sampling.temperature)
        mean_reward = result.reward_mean
        if result.samples:
            await engine.load_weights(policy.state_dict(), version=step)
        if step % eval_every == 0:
            acc = await evaluate()
            history.append((step, acc))
            print(f"step {step}: held-out greedy accuracy {acc:.3f}  train reward {mean_reward:.3f}  "
                  f"rl {time.perf_counter() - started:.1f}s", flush=True)
            if steps_to_target is None and acc >= target:
                steps_to_target = step
        if time.perf_counter() - started > time_budget_s:
            logger.warning("time budget of %.0f s spent at step %d", time_budget_s, step)
            break
    if history[-1][0] != step:
        acc = await evaluate()
        history.append((step, acc))
    rl_seconds = time.perf_counter() - started
    return {"reward_start": reward_start, "reward_end": acc, "steps": step, "steps_to_target": steps_to_target,
            "rl_seconds": round(rl_seconds, 2), "eval_seconds": round(eval_s, 2), "history": history}


_EXAMPLE, _TRAINER, _SAMPLING = AdditionConfig(), TrainerConfig(), SamplingConfig()


def main(
    seed: Annotated[int, typer.Option(help="Seed of the data split, the model and the trainer.")] = 0,
    max_operand: Annotated[int, typer.Option(help="Operands are in [0, max-operand).")] = 50,
    n_heldout: Annotated[int, typer.Option(help="Held-out prompts.")] = 500,
    hidden: Annotated[int, typer.Option(help="Hidden size of the scratch model.")] = _EXAMPLE.model.hidden_size,
    layers: Annotated[int, typer.Option(help="Transformer blocks.")] = _EXAMPLE.model.layers,
    intermediate: Annotated[int, typer.Option(help="MLP width.")] = _EXAMPLE.model.intermediate_size,
    temperature: Annotated[float, typer.Option(help="Sampling temperature.")] = _SAMPLING.temperature,
    warmup_target: Annotated[float, typer.Option(help="Warm-up stops at this train accuracy.")]
    = _EXAMPLE.warmup.target_accuracy,
    group_size: Annotated[int, typer.Option(help="Samples per prompt.")] = _SAMPLING.group_size,
    groups_per_step: Annotated[int, typer.Option(help="Groups per trainer step.")] = _TRAINER.groups_per_step,
    lr: Annotated[float, typer.Option(help="AdamW learning rate.")] = _TRAINER.lr,
    lr_schedule: Annotated[str, typer.Option(help="constant or cosine.")] = _TRAINER.lr_schedule,
    max_steps: Annotated[int, typer.Option(help="RL steps at most.")] = _TRAINER.max_steps,
    eval_every: Annotated[int, typer.Option(help="Held-out evaluation every N steps.")] = 10,
    time_budget_s: Annotated[float, typer.Option(help="Safety cap on RL wall time.")] = 600.0,
    target: Annotated[float, typer.Option(help="Held-out accuracy reported as reached.")] = 0.8,
) -> None:
    """In-process GRPO/DAPO recipe on the addition task: a warm-up, then RL lifts held-out accuracy."""
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    scratch = _EXAMPLE.model.model_copy(update={"hidden_size": hidden, "layers": layers,
                                                "intermediate_size": intermediate, "seed": seed})
    w = _EXAMPLE.warmup.model_copy(update={"target_accuracy": warmup_target})
    cfg = TrainerConfig(lr=lr, lr_schedule=lr_schedule, groups_per_step=groups_per_step, max_steps=max_steps, seed=seed)
    sampling = SamplingConfig(group_size=group_size, temperature=temperature,
                              max_new_tokens=len(str(2 * max_operand - 2)) + 1)
    with tempfile.TemporaryDirectory(prefix="rl_recipe-") as tmp:
        train_path, heldout_path = write_dataset(Path(tmp) / "data", seed=seed, max_operand=max_operand,
                                                 n_heldout=n_heldout)
        train, heldout = read_rows(train_path), read_rows(heldout_path)
        model_dir = build_model(Path(tmp) / "model", **scratch.model_dump())
        report = supervised_warmup(
            model_dir, train, score=AdditionTask().score, target_accuracy=w.target_accuracy, max_steps=w.max_steps,
            batch_size=w.batch_size, lr=w.lr, seed=seed,
            eval_rows=random.Random(seed).sample(train, min(w.eval_prompts, len(train))),
            eval_every_steps=w.eval_every_steps)
        print(f"warm-up: {report.steps} steps, {report.seconds:.1f}s, train-prompt accuracy {report.accuracy:.3f}",
              flush=True)
        result = asyncio.run(rl_loop(model_dir, train, heldout, cfg, sampling, eval_every, time_budget_s, target))
    result.update(seed=seed, warmup_steps=report.steps, warmup_seconds=round(report.seconds, 2),
                  warmup_accuracy=report.accuracy)
    print(json.dumps(result))


if __name__ == "__main__":
    typer.run(main)
