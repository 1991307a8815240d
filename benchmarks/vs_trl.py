"""rlbus against TRL's ``GRPOTrainer`` on the same machine: time to a target held-out reward.

    .venv/bin/pip install -e '.[bench]'     # TRL
    .venv/bin/python -m benchmarks.vs_trl --json

One invocation, one system after the other:

1. ``rlbus run`` on the config (default ``configs/default.toml``, 2 local workers), keeping every
   weight version. Its prepare step builds the checkpoint once (model, supervised warm-up,
   ``save_pretrained``) and the train and held-out sets.
2. TRL's ``GRPOTrainer`` from that same checkpoint directory on the same train set, with the
   run's task as the reward function and the run's settings mapped onto ``GRPOConfig``: group
   size → ``num_generations``; prompts per step × group size → ``per_device_train_batch_size``
   (one optimizer step per generation batch, as rlbus takes); learning rate, its cosine schedule and
   floor, AdamW betas and weight decay, gradient clipping, ε_low/ε_high, temperature, top-p,
   completion length, steps and seed; token-level loss (``loss_type="dapo"``, rlbus's
   ``loss_agg = "token"``), rewards scaled by the group's std (``scale_rewards="group"``), no KL
   (β = 0, as rlbus). TRL generates in its own process with ``model.generate`` over the whole
   generation batch at once (its generation batching), on all the machine's cores
   (``torch.set_num_threads``); it needs no broker, store or second process.

Both are scored by the same code: every ``--eval-every``-th version's weights are loaded into one
``TorchEngine`` and held-out greedy accuracy is measured, after training (so measuring never slows
either run). A version's time is its trainer's wall clock since the trainer started (rlbus:
``wall_s`` of ``metrics.jsonl``; TRL: from ``on_train_begin``, the time spent copying the snapshot
taken out). ``target_reward`` defaults to 90% of the way from the checkpoint's held-out accuracy to
the lower of the two systems' best evaluated accuracies; ``speedup_time_to_target`` is TRL's time to
its first evaluated version at or above the target divided by rlbus's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.async_vs_sync import evaluate_versions, first_at
from benchmarks.launch import REPO, launch_run
from benchmarks.options import JsonOption


def run_rlbus(config: Path, out: Path, workers: int, extra: list[str]) -> Path:
    sets = {"run.name": "rlbus", "local.dir": str(out), "local.workers": str(workers),
            "weights.keep_versions": "100000", "local.unique_suffix": "false"}
    return launch_run(config, out, "rlbus", sets, extra, label=f"{workers} workers: ")


def trl_config(cfg: dict, out: Path, max_steps: int | None = None):
    """GRPOConfig from the rlbus run's resolved config (``config.json`` of its run directory)."""
    from trl import GRPOConfig

    if cfg.get("policies"):
        raise SystemExit("benchmarks.vs_trl compares single-policy runs: the config names several policies")
    trainer, sampling = cfg["trainer"], cfg["sampling"]
    group, prompts = sampling["group_size"], trainer["groups_per_step"]
    schedule = {"constant": ("constant", {}),
                "cosine": ("cosine_with_min_lr", {"min_lr_rate": trainer["min_lr_ratio"]})}[trainer["lr_schedule"]]
    return GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        logging_steps=50, disable_tqdm=True, seed=cfg["run"]["seed"], data_seed=cfg["run"]["seed"], dataloader_num_workers=0,
        max_steps=max_steps or trainer["max_steps"], per_device_train_batch_size=prompts * group, gradient_accumulation_steps=1,
        num_generations=group, num_iterations=1, learning_rate=trainer["lr"], lr_scheduler_type=schedule[0],
        lr_scheduler_kwargs=schedule[1], warmup_steps=0, adam_beta1=trainer["betas"][0], adam_beta2=trainer["betas"][1],
        weight_decay=trainer["weight_decay"], max_grad_norm=trainer["grad_clip"], epsilon=trainer["clip_low"],
        epsilon_high=trainer["clip_high"], beta=0.0, loss_type="dapo", scale_rewards="group",
        temperature=sampling["temperature"], top_p=sampling["top_p"], max_completion_length=sampling["max_new_tokens"],
        remove_unused_columns=False, torch_compile=False,
    )


def run_trl(run_dir: Path, every: int, threads: int, max_steps: int | None = None) -> tuple[list[dict], dict]:
    """Train with TRL from the rlbus run's checkpoint; returns (evaluated points, facts)."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from consumers.dataset import read_rows
    from producers.engines.torch_engine import TorchEngine
    from producers.evaluate import greedy_accuracy
    from producers.tasks import load_task

    cfg = json.loads((run_dir / "config.json").read_text())
    prep = json.loads((run_dir / "prepare.json").read_text())
    model_dir = Path(prep["model_dir"])
    task = load_task(cfg["run"]["task"], cfg["run"]["task_params"])
    rows = read_rows(prep["train_path"])
    dataset = Dataset.from_list([{"prompt": r.prompt, "answer": r.answer} for r in rows])
    args = trl_config(cfg, run_dir.parent, max_steps)
    torch.set_num_threads(threads)

    def reward(prompts, completions, answer, **_):
        return [float(task.score(p, c, a)) for p, c, a in zip(prompts, completions, answer)]

    snapshots: list[tuple[int, float, dict]] = []

    class Snapshots(TrainerCallback):
        """Copies the weights every ``every`` steps; the copying is kept off the clock."""

        def __init__(self) -> None:
            self.t0, self.off = 0.0, 0.0

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            if state.global_step % every == 0 or state.global_step == args.max_steps:
                at = time.perf_counter()
                snapshots.append((state.global_step, at - self.t0 - self.off,
                                  {k: v.detach().clone() for k, v in model.state_dict().items()}))
                self.off += time.perf_counter() - at

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Snapshots()])
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # TRL prints its logs on stdout; ours is the JSON
        trainer.train()
    train_wall = time.perf_counter() - started
    torch.set_num_threads(2)
    held = read_rows(prep["heldout_path"])
    engine = TorchEngine(model_dir, seed=cfg["run"]["seed"])
    points = [{"version": 0, "wall_s": 0.0, "reward": prep["reward_start"]}]
    for step, wall, state in snapshots:
        asyncio.run(engine.load_weights(state, step))
        points.append({"version": step, "wall_s": round(wall, 2),
                       "reward": asyncio.run(greedy_accuracy(engine, task, held, cfg["sampling"]["max_new_tokens"]))})
    return points, {"trl_version": trl.__version__, "trl_train_wall_s": round(train_wall, 1), "trl_threads": threads,
                    "trl_settings": {k: getattr(args, k) for k in (
                        "per_device_train_batch_size", "num_generations", "learning_rate", "lr_scheduler_type",
                        "max_steps", "loss_type", "scale_rewards", "beta", "epsilon", "epsilon_high",
                        "temperature", "top_p", "max_completion_length", "max_grad_norm")}}


def main(
    config: Annotated[Path, typer.Option(help="rlbus run config; TRL takes the same settings.")] = REPO / "configs" / "default.toml",
    workers: Annotated[int, typer.Option(help="rlbus local workers.")] = 2,
    eval_every: Annotated[int, typer.Option(help="Evaluate every N-th version of each system.")] = 20,
    threads: Annotated[int, typer.Option(help="torch threads of the TRL process (default: every core).")] = os.cpu_count() or 2,
    target: Annotated[float | None, typer.Option(help="Target held-out reward (default: see the module doc).")] = None,
    out: Annotated[Path, typer.Option(help="Parent directory of the runs.")] = REPO / "runs" / "vs_trl",
    sets: Annotated[list[str], typer.Option("--set", help="Override for both systems (KEY=VALUE, rlbus config).")] = [],  # noqa: B006
    reuse: Annotated[Path | None, typer.Option(help="Compare against this finished rlbus run directory (it must "
                                                     "keep every version) instead of starting one.")] = None,
    trl_steps: Annotated[int | None, typer.Option(help="TRL steps (default: the run's trainer.max_steps).")] = None,
    json_out: JsonOption = False,
) -> None:
    """rlbus against TRL's GRPOTrainer on this machine: time to a target held-out reward."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        raise SystemExit("benchmarks.vs_trl needs TRL: .venv/bin/pip install -e '.[bench]'")
    out = out.resolve() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    run_dir = reuse.resolve() if reuse is not None else run_rlbus(config, out, workers, sets)
    summary = json.loads((run_dir / "summary.json").read_text())
    ours = evaluate_versions(run_dir, eval_every)
    print(f"[rlbus] rl {summary['rl_wall_s']:.0f}s, held-out {summary['reward_start']:.3f} -> "
          f"{summary['reward_end']:.3f}", file=sys.stderr, flush=True)
    theirs, facts = run_trl(run_dir, eval_every, threads, trl_steps)
    print(f"[trl] train {facts['trl_train_wall_s']:.0f}s, held-out {theirs[0]['reward']:.3f} -> "
          f"{theirs[-1]['reward']:.3f}", file=sys.stderr, flush=True)
    start = summary["reward_start"]
    best = min(max(p["reward"] for p in ours), max(p["reward"] for p in theirs))
    target = target if target is not None else round(start + 0.9 * (best - start), 3)
    p_ours, p_theirs = first_at(ours, target), first_at(theirs, target)
    t_ours, t_theirs = (None if p is None else p["wall_s"] for p in (p_ours, p_theirs))
    result = {
        "config": str(config), "rlbus_run_dir": str(run_dir), "cpu_count": os.cpu_count(), "rlbus_workers": workers, "reward_start": start,
        "target_reward": target,
        "rlbus_time_to_target_s": t_ours, "trl_time_to_target_s": t_theirs,
        "rlbus_versions_to_target": None if p_ours is None else p_ours["version"],
        "trl_steps_to_target": None if p_theirs is None else p_theirs["version"],
        "speedup_time_to_target": round(t_theirs / t_ours, 2) if t_ours and t_theirs else None,
        "rlbus_final_reward": summary["reward_end"], "trl_final_reward": theirs[-1]["reward"],
        "rlbus_rl_wall_s": summary["rl_wall_s"], "rlbus_trainer_wait_fraction": summary["trainer_wait_fraction"],
        **facts,
        "rlbus_curve": [[p["version"], p["wall_s"], round(p["reward"], 3)] for p in ours],
        "trl_curve": [[p["version"], p["wall_s"], round(p["reward"], 3)] for p in theirs],
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=None if json_out else 1))


if __name__ == "__main__":
    typer.run(main)
