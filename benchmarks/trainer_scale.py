"""The trainer at a model size: throughput, peak memory and MFU of real optimizer steps, with the
publication time per version beside the step time, against the path before micro-batches and the
chunked LM head, measured in the same run.

    .venv/bin/python -m benchmarks.trainer_scale --json                  # whatever device is present
    .venv/bin/python -m benchmarks.trainer_scale --device cpu --json
    .venv/bin/python -m benchmarks.trainer_scale --size 0.37b --ranks 2  # torchrun: gloo on CPUs, NCCL on GPUs

A Qwen3-shaped checkpoint of the chosen size is built from scratch (``rlbus.examples.scratch``) and
loaded by the trainer's own loading code (``trainer.learner.build_learner``: the fast-path check,
activation checkpointing when asked, FSDP2 over ranks). Steps are real: ``Learner.step`` on groups of
random tokens (rewards that differ within every group, stale behaviour log-probs), AdamW, bf16
autocast on GPUs ("auto"). After each step the full weights are gathered (``Learner.weights``) and
published by the real publisher into a local directory store: ``publish_s`` is that, per version
(the trainer runs it beside the next step).

Sizes: ``cpu`` (the default on a CPU) is small with Qwen's 151,936-token vocabulary, where the
logits dominate memory; ``0.37b`` (28 layers, hidden 1024, GQA 16/8, vocab 8,192) and ``1.5b``
(28 layers, hidden 1536, GQA 12/2, intermediate 8,960, vocab 151,936, tied) are the GPU defaults,
at 32 groups × 8 samples × (128 + 256) tokens per step.

Each configuration runs in a process of its own (``--one``), so that its peak is its own: on a GPU
``torch.cuda.max_memory_allocated`` over the measured steps (weights, gradients, optimizer state and
activations); on a CPU the process's peak resident memory over them (``VmHWM`` after resetting it,
with glibc's mmap threshold fixed so freed tensors leave). ``old_*`` is the path before this
trainer had micro-batches and the chunked head: the whole update in one pass, its [completion
tokens × vocab] float32 logits kept for the backward (``micro_batch_tokens`` past the batch,
``logits_chunk_mib = 0``); null when it does not fit (out of memory). ``plain_*``: the new path with
the plain forward (``shared_prefix = false``), to see what the shared prefix saves.

Figures: ``tokens_per_s`` counts every token of every sample (prompt and completion) per second of
step; ``mfu`` = 6 · N · tokens / step time / the device's peak, N the parameters less an untied input
embedding (a lookup; it does no multiply) (bf16 dense tensor-core
peak for known GPUs; otherwise the best float32 (CPU) or bfloat16 (GPU) matmul rate measured here,
``peak_flops``); ``loss`` and ``grad_norm`` of the first step, for both paths (equal up to float
rounding: the same update).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks.options import JsonOption

REPO = Path(__file__).resolve().parents[1]

SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, layers=2, heads=4, kv_heads=2, intermediate_size=128, vocab_size=151_936),
    "cpu": dict(hidden_size=256, layers=4, heads=4, kv_heads=2, intermediate_size=768, vocab_size=151_936),
    "0.37b": dict(hidden_size=1024, layers=28, heads=16, kv_heads=8, intermediate_size=3072, vocab_size=8192),
    "1.5b": dict(hidden_size=1536, layers=28, heads=12, kv_heads=2, intermediate_size=8960, vocab_size=151_936,
                 tie_embeddings=True),
}
BATCHES = {"cpu": (6, 8, 64, 96), "gpu": (32, 8, 128, 256)}
"""groups, samples per group, prompt tokens, completion tokens"""
GPU_PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
                 "L4": 121e12, "A10": 125e12}
OLD_PATH = ["micro_batch_tokens=1073741824", "logits_chunk_mib=0"]


def build(size: str, out: Path) -> Path:
    """The checkpoint of ``size`` under ``out`` (built once)."""
    from rlbus.examples.scratch import build_checkpoint, train_bpe_tokenizer

    path = out / f"qwen3-{size}"
    if (path / "config.json").is_file():
        return path
    tokenizer = train_bpe_tokenizer([f"{a} plus {b} is {a + b}." for a in range(40) for b in range(40)], vocab_size=300)
    return build_checkpoint(path, tokenizer, arch="qwen3", max_position_embeddings=1024, **SIZES[size])


def groups_for(vocab: int, groups: int, size: int, prompt: int, completion: int, seed: int = 0) -> list:
    import numpy as np

    from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader

    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        tokens = rng.integers(4, vocab, size=size * completion).astype(np.int32)
        rewards = [float(i % 2) for i in range(size)]
        header = TrajectoryHeader(
            run="bench", policy="main", group_id=f"g{seed}-{g}", prompt_id=f"p{g}", task="bench", worker_id="w",
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=completion), rewards=rewards,
            finish_reasons=["length"] * size, min_version=0, max_version=0, vocab_size=vocab, created_at=time.time())
        out.append(TrajectoryGroup(
            header=header, prompt_tokens=rng.integers(4, vocab, size=prompt).astype(np.int32), completion_tokens=tokens,
            completion_offsets=(np.arange(size + 1) * completion).astype(np.int32),
            behaviour_logprobs=rng.uniform(-12, -10, size=len(tokens)).astype(np.float32),
            token_versions=np.zeros(len(tokens), np.int32)))
    return out


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")


def _peak_gib(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 2**20


def peak_flops(device) -> tuple[float, str]:
    """The device's peak: bf16 dense for a GPU this module knows, else the best matmul rate measured here."""
    import torch

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_BF16.items():
            if key in name:
                return flops, f"{name}: bf16 dense peak"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = 4096 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - start) / 4)
    return 2 * n**3 / best, f"best {str(dtype).removeprefix('torch.')} matmul measured on {device}"


def one(model_dir: Path, batch: tuple[int, int, int, int], steps: int, sets: list[str]) -> dict[str, Any] | None:
    """Run ``steps`` steps (after one warm-up) in this process; rank 0's figures (None on others)."""
    from rlbus.config import load_config
    from trainer.learner import build_learner
    from trainer.ranks import join_ranks

    config = load_config(None, ["trainer.lr=1e-5", *(f"trainer.{s}" for s in sets)], environ={}).policy(None).trainer
    ranks, device = join_ranks(config.device)
    learner, _ = build_learner(config, model_dir, temperature=1.0, device=device, ranks=ranks)
    if ranks.rank != 0:
        learner.serve()
        return None
    result = _lead(learner, device, batch, steps)
    learner.stop()  # not on an error: the other ranks' collectives fail when this process is gone
    return result


def _lead(learner, device, batch: tuple[int, int, int, int], steps: int) -> dict[str, Any]:
    """Rank 0's part of ``one``."""
    import torch

    from weightstore.config import WeightsConfig
    from weightstore.objectstore import LocalDirStore
    from weightstore.publish import WeightPublisher

    ranks = learner.ranks
    groups, size, prompt, completion = batch
    vocab = learner.lm.get_input_embeddings().num_embeddings
    tokens = groups * size * (prompt + completion)
    publisher = WeightPublisher(LocalDirStore(Path(tempfile.mkdtemp(prefix="rlbus-scale-"))), "main", WeightsConfig())
    publisher.publish(0, learner.weights(publisher.dtype), owned=True)
    first = learner.step(groups_for(vocab, groups, size, prompt, completion, seed=0), 0)
    _reset_peak(device)
    step_s, publish_s = [], []
    for i in range(1, steps + 1):
        data = groups_for(vocab, groups, size, prompt, completion, seed=i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        learner.step(data, i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        publisher.publish(i, learner.weights(publisher.dtype), owned=True)
        publish_s.append(time.perf_counter() - start)
    params = sum(p.numel() for p in learner.lm.parameters())  # DTensors count their global elements
    embedding = learner.lm.get_input_embeddings().weight
    tied = embedding is learner.lm.get_output_embeddings().weight
    matmul_params = params - (0 if tied else embedding.numel())  # the input embedding is a lookup
    step = sorted(step_s)[len(step_s) // 2]
    flops, how = peak_flops(device)
    return {
        "params": params, "device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "ranks": ranks.world, "tokens_per_step": tokens, "step_s": step, "tokens_per_s": tokens / step,
        "peak_mem_gib": _peak_gib(device), "mfu": 6 * matmul_params * tokens / step / flops, "peak_flops": flops,
        "peak_flops_source": how, "publish_s": sorted(publish_s)[len(publish_s) // 2],
        "micro_batch_tokens": learner.config.micro_batch_tokens or _budget(learner),
        "logits_chunk_mib": learner.config.logits_chunk_mib, "loss": first.loss, "grad_norm": first.grad_norm,
        "describe": learner.describe(),
    }


def _budget(learner) -> int:
    from trainer.microbatch import default_micro_batch_tokens
    from trainer.step import autocast_dtype

    return default_micro_batch_tokens(learner.lm, learner.device, bf16=autocast_dtype(learner.config, learner.device)
                                      is not None, checkpointing=learner.config.gradient_checkpointing,
                                      world=learner.ranks.world)


def run_one(model_dir: Path, batch: tuple[int, int, int, int], steps: int, sets: list[str], ranks: int,
            timeout_s: float = 3600) -> dict[str, Any] | None:
    """``one`` in a fresh process (under torchrun for several ranks); None when it ran out of memory."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        args = ["-m", "benchmarks.trainer_scale", "--one", str(model_dir), "--batch", ",".join(map(str, batch)),
                "--steps", str(steps), "--out", out.name, *(a for s in sets for a in ("--set", s))]
        if ranks > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *args]
        else:
            cmd = [sys.executable, *args]
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(REPO))
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr)[-3000:]
            if "out of memory" in tail.lower() or proc.returncode in (-9, 137):
                return None
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{tail}")
        return json.loads(Path(out.name).read_text())


def compare(model_dir: Path, batch: tuple[int, int, int, int], steps: int, sets: list[str], ranks: int) -> dict:
    """The new path, the same with the plain forward instead of the shared prefix, and the old path,
    on the same checkpoint and batches."""
    new = run_one(model_dir, batch, steps, sets, ranks)
    if new is None:
        raise RuntimeError(f"{model_dir.name}: the trainer ran out of memory at {batch}: lower micro_batch_tokens")
    for prefix, extra in (("plain", ["shared_prefix=false"]), ("old", OLD_PATH)):
        other = run_one(model_dir, batch, steps, [*sets, *extra], ranks)
        for key in ("tokens_per_s", "peak_mem_gib", "loss", "grad_norm", "publish_s", "step_s"):
            new[f"{prefix}_{key}"] = None if other is None else other[key]
    return new


def main(
    device: Annotated[str, typer.Option(help="cpu, cuda, or auto (cuda when present).")] = "auto",
    size: Annotated[list[str], typer.Option(help=f"Model sizes ({', '.join(SIZES)}); default by device.")] = [],  # noqa: B006
    batch: Annotated[str, typer.Option(help="groups,samples,prompt,completion (default by device).")] = "",
    steps: Annotated[int, typer.Option(help="Measured steps after one warm-up step.")] = 2,
    ranks: Annotated[int, typer.Option(help="Trainer ranks (torchrun).")] = 1,
    sets: Annotated[list[str], typer.Option("--set", help="trainer.* override without the prefix (KEY=VALUE).")] = [],  # noqa: B006
    out: Annotated[Path, typer.Option(help="Where checkpoints are built.")] = REPO / "runs" / "trainer_scale",
    json_out: JsonOption = False,
    one_dir: Annotated[Path | None, typer.Option("--one", hidden=True)] = None,
    out_file: Annotated[Path | None, typer.Option("--out", hidden=True)] = None,
) -> None:
    import torch

    if one_dir is not None:
        result = one(one_dir, tuple(int(x) for x in batch.split(",")), steps, sets)
        if result is not None and out_file is not None:
            out_file.write_text(json.dumps(result))
        return
    gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    sizes = size or (["0.37b", "1.5b"] if gpu else ["cpu"])
    shape = tuple(int(x) for x in batch.split(",")) if batch else BATCHES["gpu" if gpu else "cpu"]
    sets = [*sets, f"device={'cuda' if gpu else 'cpu'}"]
    results = {}
    for name in sizes:
        model_dir = build(name, out)
        results[name] = compare(model_dir, shape, steps, sets, ranks)
        if not json_out:
            print(_line(name, results[name]), flush=True)
    if json_out:
        print(json.dumps(results if len(results) > 1 else next(iter(results.values())), indent=1))


def _line(name: str, r: dict) -> str:
    old = "did not fit" if r["old_peak_mem_gib"] is None else (
        f"{r['old_tokens_per_s']:.0f} tokens/s, peak {r['old_peak_mem_gib']:.2f} GiB")
    return (f"{name}: {r['params'] / 1e6:.1f}M params on {r['device']} × {r['ranks']}: {r['tokens_per_s']:.0f} tokens/s, "
            f"peak {r['peak_mem_gib']:.2f} GiB, MFU {r['mfu']:.1%}, step {r['step_s']:.2f}s, publish {r['publish_s']:.2f}s "
            f"(micro-batches of {r['micro_batch_tokens']} tokens); before: {old}")


if __name__ == "__main__":
    typer.run(main)
