"""Learning per version against the age of the behaviour weights, with nothing else changed.

    .venv/bin/python -m benchmarks.staleness --json

One process per profile, no broker and no fleet: the default config's model and data after its
supervised warm-up (``rlbus prepare``), then ``--steps`` steps of the trainer's own
``train_step`` (its loss, the default config's data stages and lr schedule). Each step's batch is
filled 16 prompts at a time (chosen as the curator chooses them, below): the TorchEngine generates each 16-prompt batch with the weights of ``lag`` versions
before the current one, ``lag`` drawn per batch from the profile's distribution, and the
behaviour log-probs and token versions of those weights go into the groups, packed as a worker
packs them (``producers.worker.pack_samples``). Every ``--eval-every`` versions, the held-out greedy accuracy is measured as
``benchmarks.async_vs_sync`` measures it.

Profiles (name: P(lag = 0, 1, 2, ...)):

* ``sync``: always 0 (the baseline: synchronous on-policy training);
* ``async``: .10 .45 .30 .10 .05 (mean 1.55, the lags of the benchmark fleet's asynchronous run
  at η = 4);
* ``lag1``: always 1;
* ``async_cap2``: ``async`` with ``trainer.importance_cap = 2``;
* ``async_m2po``: ``async`` with ``trainer.m2po_threshold = 0.04``;
* ``measured``: the lags that finished runs trained on (``--lags-from RUN_DIR ...``: the
  ``staleness_counts`` of their ``metrics.jsonl``, e.g. the asynchronous runs of
  ``benchmarks.async_vs_sync``), so that the cost of a run's own staleness is measured.

For each profile and seed it reports the first evaluated version at or above ``--target`` (a
comma-separated list gives each target), the accuracy at a few versions and the whole accuracy
curve; ``versions_ratio`` is a profile's mean versions to the (first) target over the baseline's.
``benchmarks.fleet_model --staleness-from result.json`` takes its cost of stale data from here.

Prompts are chosen as the curator chooses them (``consumers.curator.DataCursor``): the shuffled
training set epoch by epoch through the config's ``curator_stages`` (the default config skips prompts the policy solves), each group's
rewards fed back to them when it is generated. ``--no-curator-stages`` draws each batch uniformly
instead.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.options import JsonOption
from rlbus.report.summary import read_metrics

REPO = Path(__file__).resolve().parent.parent
ASYNC_LAGS = [0.10, 0.45, 0.30, 0.10, 0.05]
PROFILES: dict[str, tuple[list[float], list[str]]] = {
    "sync": ([1.0], []),
    "async": (ASYNC_LAGS, []),
    "lag1": ([0.0, 1.0], []),
    "async_cap2": (ASYNC_LAGS, ["trainer.importance_cap=2.0"]),
    "async_m2po": (ASYNC_LAGS, ["trainer.m2po_threshold=0.04"]),
}
PROMPTS_PER_BATCH = 16


def measured_lags(run_dirs: list[Path]) -> list[float]:
    """P(lag = 0, 1, ...) over the groups the runs in ``run_dirs`` trained (their metrics rows'
    ``staleness_counts``)."""
    counts: dict[int, int] = {}
    for run_dir in run_dirs:
        path = run_dir / "metrics.jsonl"
        if not path.is_file():
            raise typer.BadParameter(f"{path} does not exist: --lags-from takes finished run directories")
        for row in read_metrics(path):
            for lag, n in (row.get("staleness_counts") or {}).items():
                counts[int(lag)] = counts.get(int(lag), 0) + n
    total = sum(counts.values())
    if not total:
        raise typer.BadParameter(f"no trained groups in {[str(d) for d in run_dirs]}")
    return [round(counts.get(lag, 0) / total, 4) for lag in range(max(counts) + 1)]


def simulate(job: dict) -> dict:
    """One profile and seed: train for ``steps`` versions; returns the accuracy curve."""
    import numpy as np
    import torch

    from broker.schema import TrajectoryGroup, TrajectoryHeader
    from consumers.curator import CuratorStats, DataCursor
    from consumers.stages import apply_group_stages, build_group_stages, build_prompt_stages, observe_prompt
    from producers.engines.torch_engine import TorchEngine
    from consumers.dataset import read_rows
    from producers.evaluate import greedy_accuracy
    from producers.tasks import load_task
    from producers.worker import pack_samples
    from rlbus.config import load_config
    from trainer.model import load_policy
    from trainer.step import train_step

    torch.set_num_threads(1)
    cfg = load_config(Path(job["config"]), job["sets"], environ={})
    prep = job["prepare"]
    model_dir = Path(prep["model_dir"])
    rows, heldout = read_rows(prep["train_path"]), read_rows(prep["heldout_path"])
    task = load_task(cfg.run.task)
    model, tokenizer = load_policy(model_dir, "float32")
    t = cfg.trainer
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    torch.manual_seed(job["seed"])
    behaviour = TorchEngine(model_dir, seed=job["seed"])
    scorer = TorchEngine(model_dir, seed=job["seed"])
    sampling = cfg.sampling.params()
    stages = build_group_stages(cfg.trainer_stages)
    rng = random.Random(job["seed"])
    prompt_stages = build_prompt_stages(cfg.curator_stages) if job["curator_stages"] else None
    data = None if prompt_stages is None else DataCursor(rows, job["seed"], prompt_stages, CuratorStats())

    def next_prompts(n: int) -> list:
        """As the curator chooses them (``consumers.curator.DataCursor``), or uniformly without stages."""
        return rng.sample(rows, n) if data is None else [data.next() for _ in range(n)]

    lags = job["lags"]
    history: deque = deque([(0, {k: v.clone() for k, v in model.state_dict().items()})], maxlen=len(lags))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    curve, made = [], 0
    for version in range(job["steps"]):
        for group in optimizer.param_groups:
            group["lr"] = t.lr * t.lr_multiplier(version)
        batch: list = []
        while len(batch) < t.groups_per_step:
            lag = min(rng.choices(range(len(lags)), lags)[0], len(history) - 1)
            behaviour_version, weights = history[lag]
            if behaviour.version != behaviour_version:
                asyncio.run(behaviour.load_weights(weights, behaviour_version))
            prompts = next_prompts(PROMPTS_PER_BATCH)
            tokens = [behaviour.tokenizer(p.prompt)["input_ids"] for p in prompts]
            results = asyncio.run(behaviour.generate_batch(tokens, cfg.sampling.group_size, sampling))
            groups = []
            for prompt, prompt_tokens, samples in zip(prompts, tokens, results):
                header = TrajectoryHeader(
                    run="staleness", policy="main", group_id=f"g{made}", prompt_id=f"p{made}", task=task.name,
                    worker_id="benchmark", sampling=sampling,
                    rewards=[task.score(prompt.prompt, s.text, prompt.answer) for s in samples],
                    finish_reasons=[s.finish_reason for s in samples], min_version=behaviour_version,
                    max_version=behaviour_version, vocab_size=len(tokenizer), created_at=time.time(),
                )
                if prompt_stages is not None:
                    observe_prompt(prompt_stages, prompt.key, header.rewards)
                groups.append(TrajectoryGroup(header=header, prompt_tokens=np.asarray(prompt_tokens, np.int32),
                                              **pack_samples(samples)))
                made += 1
            batch += apply_group_stages(stages, groups, version)
        train_step(model, optimizer, batch[: t.groups_per_step], t, pad_id=pad_id, temperature=cfg.sampling.temperature)
        history.appendleft((version + 1, {k: v.clone() for k, v in model.state_dict().items()}))
        if (version + 1) % job["eval_every"] == 0:
            asyncio.run(scorer.load_weights(model.state_dict(), version + 1))
            accuracy = asyncio.run(greedy_accuracy(scorer, task, heldout, cfg.sampling.max_new_tokens))
            curve.append((version + 1, round(accuracy, 3)))
    return {"profile": job["profile"], "seed": job["seed"], "curve": curve}


def main(
    config: Annotated[Path, typer.Option(help="Run config (model, data, trainer).")] = REPO / "configs" / "default.toml",
    profiles: Annotated[str, typer.Option(help=f"Comma-separated, the first is the baseline; known: {', '.join(PROFILES)}.")]
    = "sync,async,lag1,async_cap2,async_m2po",
    seeds: Annotated[int, typer.Option(help="Seeds per profile (0, 1, ...).")] = 1,
    steps: Annotated[int, typer.Option(help="Versions trained per profile and seed.")] = 560,
    eval_every: Annotated[int, typer.Option(help="Evaluate every N-th version.")] = 20,
    target: Annotated[str, typer.Option(help="Held-out accuracy to reach; comma-separated for several.")] = "0.88",
    lags_from: Annotated[list[Path] | None, typer.Option(
        "--lags-from", help="Run directories whose trained lags make the 'measured' profile (repeatable).")] = None,
    processes: Annotated[int, typer.Option(help="Profiles simulated at once (one core each).")] = 2,
    curator_stages: Annotated[bool, typer.Option(help="Choose prompts through the config's curator_stages (as the curator does); off: uniformly.")] = True,
    json_out: JsonOption = False,
) -> None:
    """Learning per version against the age of the behaviour weights, with nothing else changed."""
    names = profiles.split(",")
    known = dict(PROFILES)
    if lags_from:
        known["measured"] = (measured_lags(lags_from), [])
        if "measured" not in names:
            names.append("measured")
    elif "measured" in names:
        raise typer.BadParameter("the 'measured' profile needs --lags-from RUN_DIR")
    targets = [float(t) for t in target.split(",")]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise typer.BadParameter(f"unknown profile(s) {unknown}; known: {[*PROFILES, 'measured']}")

    from rlbus.config import load_config
    from rlbus.roles import prepare as run_prepare

    out = Path(tempfile.mkdtemp(prefix="rlbus-staleness-"))
    prepare = run_prepare(load_config(config, [], environ={}), out)
    print(f"prepared: warm-up {prepare['warmup_steps']} steps, held-out accuracy {prepare['reward_start']:.3f}",
          file=sys.stderr, flush=True)
    jobs = [
        {"profile": n, "seed": s, "lags": known[n][0], "sets": known[n][1], "config": str(config),
         "prepare": prepare, "steps": steps, "eval_every": eval_every,
         "curator_stages": curator_stages}
        for s in range(seeds) for n in names
    ]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        runs = []
        for run in pool.imap(simulate, jobs):
            runs.append(run)
            firsts = [to_target(run, t) for t in targets]
            print(f"[{run['profile']} seed {run['seed']}] {targets} first at versions {firsts}", file=sys.stderr, flush=True)

    result: dict = {"target": targets[0], "targets": targets, "steps": steps, "eval_every": eval_every, "seeds": seeds,
                    "curator_stages": curator_stages,
                    "reward_start": prepare["reward_start"], "baseline": names[0], "profiles": {}}
    for name in names:
        mine = [r for r in runs if r["profile"] == name]
        lags = known[name][0]
        result["profiles"][name] = {
            "lags": lags,
            "lag_mean": round(sum(i * p for i, p in enumerate(lags)) / sum(lags), 3),
            "overrides": known[name][1],
            "versions_to_target": [to_target(r, targets[0]) for r in mine],
            "versions_to_targets": {str(t): [to_target(r, t) for r in mine] for t in targets},
            "accuracy_at": {str(v): [dict(r["curve"]).get(v) for r in mine] for v in (200, 300, 400)},
            "curves": [r["curve"] for r in mine],
        }
    base = [v for v in result["profiles"][names[0]]["versions_to_target"] if v is not None]
    for name in names:
        reached = [v for v in result["profiles"][name]["versions_to_target"] if v is not None]
        result["profiles"][name]["versions_ratio"] = (
            round(statistics.mean(reached) / statistics.mean(base), 2) if reached and base else None
        )
    print(json.dumps(result, indent=None if json_out else 1))


def to_target(run: dict, target: float) -> int | None:
    """The first evaluated version at or above ``target``."""
    return next((v for v, a in run["curve"] if a >= target), None)


if __name__ == "__main__":
    typer.run(main)
