"""In-process GRPO/DAPO recipe on the addition task: a warm-up, then RL lifts held-out accuracy.

Everything the distributed run does, on one thread and without Kafka or S3: build a tiny model
from scratch, supervised warm-up to a low accuracy on train prompts, then repeat
``TorchEngine.generate_batch -> AdditionEnv.score -> trainer.step.train_step`` (the trainer's own step) and hand
the new weights to the engine after every step. Held-out greedy accuracy is printed as it goes;
the last line is one JSON object.

    .venv/bin/python benchmarks/rl_recipe.py --seed 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from broker.schema import TrajectoryGroup, TrajectoryHeader
from producers.config import SamplingConfig
from producers.engine import GenerationResult, TorchEngine
from producers.envs import AdditionEnv, read_dataset, write_addition_dataset
from producers.evaluate import greedy_accuracy
from trainer.basemodel import build_base_model, load_policy
from trainer.config import ModelConfig, TrainerConfig
from trainer.step import train_step
from trainer.warmup import supervised_warmup

logger = logging.getLogger("rl_recipe")


def to_group(row: dict, prompt: list[int], results: list[GenerationResult], rewards: list[float],
             sampling: SamplingConfig, vocab_size: int, created_at: float) -> TrajectoryGroup:
    """The trajectory-group record a rollout worker would publish for one prompt."""
    versions = [v for r in results for v in r.versions]
    header = TrajectoryHeader(
        run="recipe", policy="main", group_id=f"{row['prompt_id']}-{created_at}", prompt_id=row["prompt_id"],
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


async def rl_loop(model_dir: Path, train: list[dict], heldout: list[dict], cfg: TrainerConfig,
                  sampling: SamplingConfig, eval_every: int, time_budget_s: float, target: float) -> dict:
    env = AdditionEnv()
    engine = TorchEngine(model_dir, seed=cfg.seed)
    policy, tokenizer = load_policy(model_dir)
    policy.train()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    max_eval_tokens = max(len(r["answer"]) for r in heldout) + 1
    eval_s = 0.0

    async def evaluate() -> float:
        nonlocal eval_s
        t0 = time.perf_counter()
        acc = await greedy_accuracy(engine, env, heldout, max_eval_tokens, batch_size=512)
        eval_s += time.perf_counter() - t0
        return acc

    reward_start = await evaluate()
    print(f"step 0: held-out greedy accuracy {reward_start:.3f}", flush=True)
    started = time.perf_counter()
    history, steps_to_target, step, acc = [(0, reward_start)], None, 0, reward_start
    for step in range(1, cfg.max_steps + 1):
        rows = rng.sample(train, cfg.groups_per_step)
        prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
        created = time.time()
        outs = await engine.generate_batch(prompts, sampling.group_size, sampling.params())
        groups = []
        for row, prompt, results in zip(rows, prompts, outs):
            rewards = [env.score(row["prompt"], r.text, row["answer"]) for r in results]
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


def main() -> None:
    model_defaults, trainer_defaults, sampling_defaults = ModelConfig(), TrainerConfig(), SamplingConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-operand", type=int, default=50, help="operands are in [0, max-operand)")
    p.add_argument("--n-heldout", type=int, default=500)
    p.add_argument("--hidden", type=int, default=model_defaults.hidden_size)
    p.add_argument("--layers", type=int, default=model_defaults.layers)
    p.add_argument("--intermediate", type=int, default=model_defaults.intermediate_size)
    p.add_argument("--temperature", type=float, default=sampling_defaults.temperature)
    p.add_argument("--warmup-target", type=float, default=model_defaults.warmup.target_accuracy)
    p.add_argument("--group-size", type=int, default=sampling_defaults.group_size)
    p.add_argument("--groups-per-step", type=int, default=trainer_defaults.groups_per_step)
    p.add_argument("--lr", type=float, default=trainer_defaults.lr)
    p.add_argument("--lr-schedule", choices=["constant", "cosine"], default=trainer_defaults.lr_schedule)
    p.add_argument("--max-steps", type=int, default=trainer_defaults.max_steps)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--time-budget-s", type=float, default=600.0, help="safety cap on RL wall time")
    p.add_argument("--target", type=float, default=0.8, help="held-out accuracy reported as reached")
    args = p.parse_args()
    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    model_cfg = ModelConfig(hidden_size=args.hidden, layers=args.layers, intermediate_size=args.intermediate, seed=args.seed,
                            warmup=model_defaults.warmup.model_copy(update={"target_accuracy": args.warmup_target}))
    cfg = TrainerConfig(lr=args.lr, lr_schedule=args.lr_schedule, groups_per_step=args.groups_per_step, max_steps=args.max_steps, seed=args.seed)
    sampling = SamplingConfig(group_size=args.group_size, temperature=args.temperature, max_new_tokens=len(str(2 * args.max_operand - 2)) + 1)
    with tempfile.TemporaryDirectory(prefix="rl_recipe-") as tmp:
        train_path, heldout_path = write_addition_dataset(
            Path(tmp) / "data", seed=args.seed, max_operand=args.max_operand, n_heldout=args.n_heldout)
        train, heldout = read_dataset(train_path), read_dataset(heldout_path)
        model_dir = build_base_model(
            Path(tmp) / "model", arch=model_cfg.arch, hidden_size=model_cfg.hidden_size, layers=model_cfg.layers,
            heads=model_cfg.heads, intermediate_size=model_cfg.intermediate_size,
            max_position_embeddings=model_cfg.max_position_embeddings, seed=model_cfg.seed)
        w = model_cfg.warmup
        report = supervised_warmup(
            model_dir, train, target_accuracy=w.target_accuracy, max_steps=w.max_steps, batch_size=w.batch_size,
            lr=w.lr, seed=args.seed, eval_rows=random.Random(args.seed).sample(train, min(w.eval_prompts, len(train))),
            eval_every_steps=w.eval_every_steps)
        print(f"warm-up: {report.steps} steps, {report.seconds:.1f}s, train-prompt accuracy {report.accuracy:.3f}",
              flush=True)
        result = asyncio.run(rl_loop(model_dir, train, heldout, cfg, sampling, args.eval_every,
                                     args.time_budget_s, args.target))
    result.update(seed=args.seed, warmup_steps=report.steps, warmup_seconds=round(report.seconds, 2),
                  warmup_accuracy=report.accuracy)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
