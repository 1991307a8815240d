"""A mixture-of-experts policy through rlbus (issue 43): what its routing costs on the wire, how far the
trainer's routing and log-probs drift from the rollout's without Rollout Routing Replay and with it, how
evenly a step's micro-batches load the experts, and what replay does to the held-out score.

    .venv/bin/python -m benchmarks.moe --json

Two real ``rlbus run``s of ``--config`` (default ``configs/moe.toml``: addition, a small Qwen3-MoE, 4 experts,
top-2), everything else equal: ``trainer.routing_replay`` true, then false (the second starts from the first's
warmed-up model and data, ``model.path``/``data.path``); both with ``trainer.autocast_dtype = --autocast``
(default bfloat16: the trainer's forward in bfloat16, the workers' torch engine in float32, the mismatch
replay is for; on this 2-core CPU bfloat16 autocast made a step's training about 1.7x slower, 1.4 s against
0.84 s, ``train_s_per_step``).

Then, on the replay run's newest version, the torch engine (float32) samples ``group_size`` completions of
each held-out prompt (``--prompts``: the first N; default all) and records their routing; from those groups:

* ``routing_bytes_per_token``: encoded record bytes with routing minus without (``broker.codec.encode_group``),
  per completion token (the prompt's rows are in the bytes, not in the count); ``routing_section_bytes_per_token``
  the routing section alone; ``routing_raw_bytes_per_token`` the int16 array it codes.
* ``routing_entropy_bytes_per_token``: the honest entropy (``routing_codec.routing_entropy``: per group the
  better of the adaptive order-0 and order-1 measures, which pay for learning their tables, as the codec
  does); ``routing_order{0,1}_bytes_per_token`` the plug-in ones (no bound on one group), and
  ``routing_codec_vs_entropy`` = section ÷ honest entropy (goal <= 1.1); ``..._ans`` the same for the
  section's ANS words alone (without its fixed head and counts, 29 bytes a group at 2 layers).
* ``flip_rate_no_replay``: with the trainer's forward in bfloat16 autocast, routing itself, the fraction of
  (position, MoE layer) pairs whose top-k set differs from the recorded one, over the positions that predict
  a completion token (``flip_rate_all_positions``: every recorded position, prompts included).
* ``logprob_gap_{no_replay,replay}``: mean |trainer log-prob − behaviour log-prob| over completion tokens,
  the same bfloat16 trainer routing itself or replaying the recorded routing; ``ratio_std_*``: the std of
  exp(trainer − behaviour), the importance ratio's spread at zero staleness. ``*_fp32``: the same with a
  float32 trainer (the engine's numerics): the baseline, ~0.
* ``imbalance_arrival``, ``imbalance_balanced``: ``trainer.microbatch.expert_imbalance``'s mean (max ÷ mean
  load of the experts, per micro-batch and layer) of one step's batch (the first ``groups_per_step`` groups)
  planned in arrival order and expert-balanced, with ``--micro-batch-tokens``; under ``imbalance`` every
  figure (slowdown, micro-batch counts) for 1 rank and 2 ranks (both ranks' plans), and at the CPU's default
  budget (8,192 tokens: one micro-batch a step here, nothing to balance).
* ``reward_start``, ``reward_end`` (replay on), ``reward_end_no_replay``: held-out greedy scores (summary.json)
  before RL and at the end of each run, with each run's wall time (``wall_s_*``: the whole run, the replay run's
  warm-up included; ``rl_wall_s_*``: its trainer steps), steps and mean importance weight (under ``runs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import numpy as np
import typer

from benchmarks.launch import REPO, launch_run
from benchmarks.options import JsonOption

CPU_BUDGET = 8192  # trainer.microbatch.CPU_MICRO_BATCH_TOKENS, without importing torch at --help


# ----------------------------------------------------------------------------- measurements


def record_groups(engine, task, rows, *, group_size: int, temperature: float, max_new_tokens: int) -> list:
    """One trajectory group per row (``.prompt``, ``.answer``, ``.messages``): ``group_size`` completions
    sampled by ``engine`` with the routing it recorded, built as a worker builds them."""
    from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader
    from producers.engines.base import routed_experts
    from producers.prompts import prompt_token_ids
    from producers.worker import pack_samples

    sampling = SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens)
    prompts = [prompt_token_ids(engine.tokenizer, r.prompt, r.messages) for r in rows]
    results = asyncio.run(engine.generate_batch(prompts, group_size, sampling))
    groups = []
    for i, (row, prompt, samples) in enumerate(zip(rows, prompts, results, strict=True)):
        header = TrajectoryHeader(
            run="bench-moe", policy="main", group_id=f"p{i}/main", prompt_id=f"p{i}", task=task.name,
            worker_id="bench", engine=engine.name, sampling=sampling,
            rewards=[task.score(row.prompt, s.text, row.answer) for s in samples],
            finish_reasons=[s.finish_reason for s in samples], min_version=engine.version,
            max_version=engine.version, vocab_size=engine.vocab_size, created_at=time.time(),
            routing=engine.routing_shape)
        groups.append(TrajectoryGroup(
            header=header, prompt_tokens=np.asarray(prompt, np.int32), **pack_samples(samples),
            routed_experts=routed_experts(samples, len(prompt), engine.routing_shape)))
    return groups


def routing_size(groups: list) -> dict[str, float]:
    """The routing's bytes per completion token on the wire, beside its raw size and its entropy."""
    from broker.codec import encode_group
    from broker.routing_codec import encode_routing, routing_entropy

    tokens = sum(len(g.completion_tokens) for g in groups)
    total = dict.fromkeys(("record", "dense", "section", "ans", "raw", "honest", "order0_bits", "order1_bits",
                           "order0_adaptive_bits", "order1_adaptive_bits"), 0.0)
    for g in groups:
        shape, routed = g.header.routing, g.routed_experts
        dense = dataclasses.replace(g, routed_experts=None, header=g.header.model_copy(update={"routing": None}))
        section = encode_routing(routed, shape, len(g.prompt_tokens), g.completion_offsets)
        total["record"] += len(encode_group(g))
        total["dense"] += len(encode_group(dense))
        total["section"] += len(section)
        total["ans"] += 4 * _ans_words(section, shape.layers)
        total["raw"] += routed.size * 2
        measures = routing_entropy(routed, shape)
        for name in ("order0_bits", "order1_bits", "order0_adaptive_bits", "order1_adaptive_bits"):
            total[name] += measures[name] * routed.shape[0] / 8
        total["honest"] += min(measures["order0_adaptive_bits"], measures["order1_adaptive_bits"]) * routed.shape[0] / 8
    per = {k: v / max(tokens, 1) for k, v in total.items()}
    return {
        "completion_tokens": tokens, "groups": len(groups),
        "routing_bytes_per_token": round(per["record"] - per["dense"], 4),
        "routing_section_bytes_per_token": round(per["section"], 4),
        "routing_raw_bytes_per_token": round(per["raw"], 4),
        "routing_entropy_bytes_per_token": round(per["honest"], 4),
        "routing_order0_bytes_per_token": round(per["order0_bits"], 4),
        "routing_order1_bytes_per_token": round(per["order1_bits"], 4),
        "routing_order0_adaptive_bytes_per_token": round(per["order0_adaptive_bits"], 4),
        "routing_order1_adaptive_bytes_per_token": round(per["order1_adaptive_bits"], 4),
        "routing_codec_vs_entropy": round(total["section"] / max(total["honest"], 1e-9), 3),
        "routing_codec_vs_entropy_ans": round(total["ans"] / max(total["honest"], 1e-9), 3),
        "record_bytes_per_token": round(per["record"], 4), "dense_record_bytes_per_token": round(per["dense"], 4),
    }


def _ans_words(section: bytes, layers: int) -> int:
    """The ANS word count of a SETS routing section (``broker.routing_codec``'s layout); 0 for RAW."""
    if section[0] != 1:
        return 0
    at = 17  # u8 coding, u32 rows, u32 layers, u16 top_k, u16 experts, u32 CRC
    (runs,) = struct.unpack_from("<I", section, at)
    return struct.unpack_from("<I", section, at + 4 + 8 * runs + 2 * layers)[0]


def mismatch(lm, groups: list, pad_id: int, *, autocast, temperature: float = 1.0,
             shared_prefix: bool = True) -> dict[str, float]:
    """The trainer's routing and log-probs against the engine's recorded ones, the trainer's forward under
    ``autocast`` (a torch dtype, or None: float32): the flip rate of its own routing, and the log-prob gap and
    importance ratio's spread routing itself and replaying the recorded routing."""
    import torch

    from trainer.batch import collate
    from trainer.logprobs import PolicyModel
    from producers.engines.moe import find_routers

    batch = collate(groups, pad_id)
    trained = batch.completion_mask > 0
    recorded = batch.routing.long()
    numerics = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast is not None else contextlib.nullcontext
    policy = PolicyModel(lm, shared_prefix=shared_prefix)
    with torch.no_grad():
        with numerics(), find_routers(lm).record() as recorder:
            lm.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        own = recorder.take().unflatten(0, tuple(batch.input_ids.shape))
        with numerics():
            live, _ = policy(dataclasses.replace(batch, routing=None), temperature)
        with numerics():
            replayed, _ = policy(batch, temperature)
    flipped = (own != recorded).any(-1)  # [N, L, layers]
    seen = (recorded[..., 0] >= 0) & (batch.attention_mask[..., None] > 0)
    predicting = seen[:, :-1] & trained[..., None]  # position j predicts completion token j + 1
    out = {"flip_rate": float(flipped[:, :-1][predicting].float().mean()),
           "flip_rate_all_positions": float(flipped[seen].float().mean())}
    behaviour = batch.behaviour_logprobs[trained].double()
    for name, logp in (("no_replay", live), ("replay", replayed)):
        diff = logp[trained].double() - behaviour
        out |= {f"logprob_gap_{name}": float(diff.abs().mean()), f"logprob_gap_max_{name}": float(diff.abs().max()),
                f"ratio_std_{name}": float(diff.exp().std())}
    return {k: round(v, 6) for k, v in out.items()}


def imbalance(groups: list, pad_id: int, budget: int, *, world: int = 1, shared_prefix: bool = True) -> dict:
    """``expert_imbalance`` of one step's batch planned by ``world`` ranks (every rank's plan) with ``budget``
    tokens a micro-batch, in arrival order and expert-balanced."""
    from trainer.batch import collate
    from trainer.microbatch import expert_imbalance, plan

    batch = collate(groups, pad_id)
    out = {}
    for name, balance in (("arrival", False), ("balanced", True)):
        plans = [plan(batch, budget, shared_prefix=shared_prefix, world=world, rank=r, balance_experts=balance)
                 for r in range(world)]
        out[name] = {k: round(v, 4) for k, v in expert_imbalance(batch, plans, shared_prefix=shared_prefix).items()}
    return out


# ----------------------------------------------------------------------------- runs


def one_run(config: Path, out: Path, name: str, sets: dict[str, str], extra: list[str]) -> dict:
    run_dir = launch_run(config, out, name, {"run.name": name, "local.dir": str(out),
                                             "local.unique_suffix": "false", **sets}, extra)
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    weights = [r["loss_importance_weight_mean"] for r in rows if r.get("loss_importance_weight_mean") is not None]
    return {
        "run_dir": str(run_dir), "reward_start": summary["reward_start"], "reward_end": summary["reward_end"],
        "steps": max((r["step"] for r in rows), default=0), "wall_s": summary["wall_s"],
        "rl_wall_s": summary["rl_wall_s"], "warmup_seconds": summary["warmup_seconds"],
        "train_s_per_step": round(statistics.fmean(r["train_s"] for r in rows), 3) if rows else None,
        "importance_weight_mean": round(statistics.fmean(weights), 4) if weights else None,
        "last_version": max((r["version"] for r in rows), default=0),
    }


def newest_policy(run_dir: Path, version: int, seed: int):
    """The torch engine (float32) and a trainer copy (float32) of ``run_dir``'s ``version``."""
    from pydantic import TypeAdapter

    from producers.engines.torch_engine import TorchEngine
    from trainer.model import load_policy
    from weightstore.config import StoreConfig, build_store
    from weightstore.inspect import load_version

    cfg = json.loads((run_dir / "config.json").read_text())
    model_dir = Path(json.loads((run_dir / "prepare.json").read_text())["model_dir"])
    engine = TorchEngine(model_dir, device="cpu", seed=seed)
    if version:
        store = build_store(TypeAdapter(StoreConfig).validate_python(cfg["store"]))
        asyncio.run(engine.load_weights(load_version(store, cfg["run"]["policy"], version), version))
    lm, tokenizer = load_policy(model_dir, "float32", device="cpu")
    lm.load_state_dict(engine.model.state_dict())
    lm.eval()
    return engine, lm, tokenizer


def measure(run_dir: Path, version: int, *, seed: int, prompts: int | None, budget: int) -> dict[str, Any]:
    """The routing, mismatch and imbalance figures of ``run_dir``'s ``version`` on its held-out prompts."""
    import torch

    from consumers.dataset import read_rows
    from producers.tasks import load_task

    torch.set_num_threads(2)
    cfg = json.loads((run_dir / "config.json").read_text())
    rows = read_rows(json.loads((run_dir / "prepare.json").read_text())["heldout_path"])[:prompts]
    task = load_task(cfg["run"]["task"], cfg["run"].get("task_params"))
    engine, lm, tokenizer = newest_policy(run_dir, version, seed)
    sampling, trainer = cfg["sampling"], cfg["trainer"]
    groups = record_groups(engine, task, rows, group_size=sampling["group_size"],
                           temperature=sampling["temperature"], max_new_tokens=sampling["max_new_tokens"])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    shared = trainer["shared_prefix"]
    result: dict[str, Any] = {"version": version, "routing_shape": engine.routing_shape.model_dump()}
    result |= routing_size(groups)
    bf16 = mismatch(lm, groups, pad_id, autocast=torch.bfloat16, temperature=sampling["temperature"],
                    shared_prefix=shared)
    fp32 = mismatch(lm, groups, pad_id, autocast=None, temperature=sampling["temperature"], shared_prefix=shared)
    result |= {"flip_rate_no_replay": bf16.pop("flip_rate")} | bf16
    result |= {f"{k}_fp32": v for k, v in fp32.items()}
    step = groups[: trainer["groups_per_step"]]
    figures = {f"{world}_rank{'s' if world > 1 else ''}": imbalance(step, pad_id, budget, world=world,
                                                                     shared_prefix=shared) for world in (1, 2)}
    figures["1_rank_cpu_budget"] = imbalance(step, pad_id, CPU_BUDGET, shared_prefix=shared)
    one = figures["1_rank"]
    result |= {
        "imbalance_arrival": one["arrival"]["mean"], "imbalance_balanced": one["balanced"]["mean"],
        "slowdown_arrival": one["arrival"]["slowdown"], "slowdown_balanced": one["balanced"]["slowdown"],
        "imbalance_micro_batch_tokens": budget, "imbalance_groups": len(step), "imbalance": figures,
    }
    return result


def main(
    config: Annotated[Path, typer.Option(help="Run config of an MoE policy.")] = REPO / "configs" / "moe.toml",
    steps: Annotated[Optional[int], typer.Option(help="Trainer steps per run (default: the config's).")] = None,
    quick: Annotated[bool, typer.Option(help="Smoke run: 3 steps, short warm-up, 50 held-out, 16 prompts.")] = False,
    seed: Annotated[int, typer.Option(help="run.seed of both runs and the engine's sampling seed.")] = 0,
    prompts: Annotated[Optional[int], typer.Option(help="Held-out prompts to record (default: all).")] = None,
    micro_batch_tokens: Annotated[int, typer.Option(help="Micro-batch budget of the imbalance figures.")] = 128,
    autocast: Annotated[str, typer.Option(help="trainer.autocast_dtype of both runs: bfloat16 or none.")] = "bfloat16",
    out: Annotated[Path, typer.Option(help="Parent directory of the runs.")] = REPO / "runs" / "bench-moe",
    extra: Annotated[Optional[list[str]], typer.Option("--set", help="More --set KEY=VALUE for both runs.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Routing bytes, routing and log-prob mismatch with and without replay, expert balance, and RL reward."""
    if autocast not in ("bfloat16", "none"):
        raise typer.BadParameter(f"--autocast {autocast!r}: bfloat16 or none")
    out = out.resolve() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    sets = {"run.seed": str(seed), "trainer.autocast_dtype": autocast}
    if quick:
        steps, prompts = steps or 3, prompts or 16
        sets |= {"example.n_heldout": "50", "example.warmup.max_steps": "30"}
    if steps is not None:
        sets |= {"trainer.max_steps": str(steps), "local.max_wall_s": str(max(1200, 15 * steps))}
    runs = {"replay": one_run(config, out, "replay", sets | {"trainer.routing_replay": "true"}, list(extra or []))}
    prep = json.loads((Path(runs["replay"]["run_dir"]) / "prepare.json").read_text())
    same_start = {"model.path": prep["model_dir"], "data.path": prep["train_path"],
                  "data.heldout_path": prep["heldout_path"]}
    runs["no_replay"] = one_run(config, out, "no_replay", sets | same_start | {"trainer.routing_replay": "false"},
                                list(extra or []))
    print("[moe] measuring on the replay run's newest version", file=sys.stderr, flush=True)
    result = measure(Path(runs["replay"]["run_dir"]), runs["replay"]["last_version"], seed=seed, prompts=prompts,
                     budget=micro_batch_tokens)
    result |= {
        "reward_start": runs["replay"]["reward_start"], "reward_end": runs["replay"]["reward_end"],
        "reward_start_no_replay": runs["no_replay"]["reward_start"],
        "reward_end_no_replay": runs["no_replay"]["reward_end"],
        "wall_s_replay": runs["replay"]["wall_s"], "wall_s_no_replay": runs["no_replay"]["wall_s"],
        "rl_wall_s_replay": runs["replay"]["rl_wall_s"], "rl_wall_s_no_replay": runs["no_replay"]["rl_wall_s"],
        "autocast": autocast, "seed": seed, "runs": runs,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=None if json_out else 1))


if __name__ == "__main__":
    typer.run(main)
