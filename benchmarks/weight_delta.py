"""How small and how fast rlbus's weight deltas are, next to the usual baselines, on real steps.

    .venv/bin/python -m benchmarks.weight_delta --json

A Qwen2 causal LM (transformers' own architecture and random init, no download; 124.7M
parameters with the defaults) keeps fp32 master weights and takes real AdamW steps (lr 1e-6,
weight decay 0.01) on the language-modelling loss of a fresh batch of random token ids per step
(seeded). After every step the weights are cast to bf16, as the publisher does, and the change
from the previous bf16 version is encoded four ways:

* ours: ``weightstore.payload.delta_payload`` (``encode_patch`` over every large tensor and every
  bucket of small ones, the bytes a publisher uploads), applied with ``apply_delta``
  and checked with the weights hash a follower checks (``bit_exact``);
* (a) the full bf16 safetensors file; (b) the same compressed with zstd (level 3);
* (c) int32 flat indices + bf16 new values of the changed elements, per tensor, all in one
  stream compressed with zstd level 1 (the PULSE / AstraFlow-style sparse encoding; no
  per-tensor metadata is counted, which flatters it).

Definitions (figures are over the whole model; the aggregate is the mean over the measured
consecutive-version deltas, ``per_step`` lists each):

* ``density``: changed bf16 elements / all elements. ``full_bytes``: 2 bytes per parameter.
* ``ratio_vs_full`` = full_bytes / our delta bytes; ``ratio_baseline_x`` = full_bytes / x bytes;
  ``ratio_vs_baseline_c`` = baseline (c) bytes / our bytes.
* ``entropy_bound_ratio`` = full bits / H, with H = H(positions) + H(values):
  H(positions) = sum over tensors t of n_t * H_b(k_t / n_t) (positions iid within a tensor at
  its density; n_t elements, k_t changed, H_b the binary entropy), and H(values) = K * H(d),
  the empirical order-0 entropy of the value-change symbol d = (new - old bit pattern) mod
  2**16, read as a signed 16-bit integer, over all K changed elements. It ignores the old
  weights, which both sides hold.
* ``entropy_bound_ratio_conditional``: the same with both terms conditioned on the old value's
  exponent: positions iid within each (tensor, exponent) class, and H(d | exponent). The codec
  exploits exactly this side information, so its ratio can beat the first bound; this one is
  the fair yardstick for it.
* Throughput is GB (1e9 bytes) of bf16 weights per second, the best of ``--repeats`` runs per
  step, summed over steps. ``encode_gb_per_s``: ``delta_payload``; ``apply_gb_per_s``:
  ``apply_delta`` into weights the follower owns (decode, check, write); ``apply_with_copy``
  also copies every changed tensor first (what a follower does while the old weights are still
  served); ``*_1thread``: ``encode_patch`` / ``apply_patch`` in a plain loop on one thread. The
  weights hash check is timed separately. ``gb_per_cpu_second`` divides by this process's CPU
  time instead of wall time (less sensitive to other load on the machine, which
  ``load_average_1m`` reports). ``wan_seconds_per_step_1gbps`` = delta bits / 1e9.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import safetensors.torch
import torch
import transformers
import typer
import zstandard

from benchmarks.options import JsonOption
from weightstore.manifest import DELTA_CODEC, Manifest, tensor_infos, weights_sha256
from weightstore.patch.codec import apply_patch, encode_patch, tensor_bits
from weightstore.payload import apply_delta, codec_workers, delta_payload

logger = logging.getLogger("weight_delta")
State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Settings:
    """The measured model and its training (the command-line options)."""

    steps: int = 3
    lr: float = 1e-6
    batch: int = 4
    seq_len: int = 128
    repeats: int = 3
    seed: int = 0
    vocab: int = 32000
    hidden: int = 768
    intermediate: int = 2048
    layers: int = 12
    heads: int = 12
    kv_heads: int = 4


def build_model(args: Settings) -> transformers.PreTrainedModel:
    config = transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(args.seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def bf16_state(model: torch.nn.Module) -> State:
    return {n: p.detach().to(torch.bfloat16).contiguous() for n, p in model.state_dict().items()}


def entropy_bits(counts: np.ndarray) -> float:
    """Total empirical entropy in bits of symbols with these counts (count * H)."""
    c = counts[counts > 0].astype(np.float64)
    return float(-(c * np.log2(c / c.sum())).sum()) if c.size else 0.0


def binary_entropy_bits(k: np.ndarray, n: np.ndarray) -> float:
    k, n = k.astype(np.float64), n.astype(np.float64)
    keep = (k > 0) & (k < n)
    p = k[keep] / n[keep]
    return float((n[keep] * -(p * np.log2(p) + (1 - p) * np.log2(1 - p))).sum())


def entropy_bounds(old: State, new: State) -> dict[str, float]:
    """Entropy in bits of the change pattern, iid and conditioned on the old exponent."""
    pos_iid = pos_cond = 0.0
    diffs, exps = [], []
    for name in sorted(new):
        a, b = tensor_bits(old[name]), tensor_bits(new[name])
        changed = a != b
        k = int(np.count_nonzero(changed))
        pos_iid += binary_entropy_bits(np.array([k]), np.array([a.size]))
        exponent = (a >> np.uint16(7)) & np.uint16(0xFF)
        n_e = np.bincount(exponent, minlength=256)
        k_e = np.bincount(exponent[changed], minlength=256)
        pos_cond += binary_entropy_bits(k_e, n_e)
        diffs.append((b[changed] - a[changed]).view(np.int16))
        exps.append(exponent[changed])
    d = np.concatenate(diffs).view(np.uint16).astype(np.int64)
    e = np.concatenate(exps).astype(np.int64)
    val_iid = entropy_bits(np.bincount(d, minlength=1 << 16))
    _, joint = np.unique((e << 16) | d, return_counts=True)
    val_cond = entropy_bits(joint) - entropy_bits(np.bincount(e, minlength=256))  # H(d, e) - H(e)
    return {
        "positions_iid": pos_iid, "values_iid": val_iid, "positions_cond": pos_cond, "values_cond": val_cond,
    }  # fmt: skip


def baseline_sizes(old: State, new: State) -> dict[str, int]:
    full = safetensors.torch.save(new)
    sparse = []
    for name in sorted(new):
        a, b = tensor_bits(old[name]), tensor_bits(new[name])
        idx = np.flatnonzero(a != b)
        if idx.size:
            sparse += [idx.astype("<i4").tobytes(), b[idx].tobytes()]
    return {
        "a_safetensors": len(full),
        "b_safetensors_zstd3": len(zstandard.ZstdCompressor(level=3, threads=-1).compress(full)),
        "c_int32_bf16_zstd1": len(zstandard.ZstdCompressor(level=1).compress(b"".join(sparse))),
    }


class Timings(dict[str, float]):
    """Best wall and CPU seconds of each timed operation of one step."""

    def best_of(
        self, key: str, repeats: int, run: Callable[..., Any], setup: Callable[[], Any] | None = None
    ) -> Any:
        """Run ``run(setup())`` (or ``run()``) ``repeats`` times; keep the fastest; return the last
        result. CPU seconds count every thread of this process."""
        wall = cpu = math.inf
        result = None
        for _ in range(repeats):
            arg = setup() if setup else None
            start, start_cpu = time.perf_counter(), time.process_time()
            result = run(arg) if setup else run()
            wall = min(wall, time.perf_counter() - start)
            cpu = min(cpu, time.process_time() - start_cpu)
        self[key], self[f"{key}_cpu"] = wall, cpu
        return result


def measure_step(old: State, new: State, version: int, repeats: int) -> dict[str, Any]:
    full_bytes = sum(t.numel() * t.element_size() for t in new.values())
    sha = weights_sha256(new)
    manifest = Manifest(
        version=version, policy="bench", kind="delta", base_version=version - 1, anchor_version=0,
        codec=DELTA_CODEC, dtype="bfloat16", chunks=[], tensors=tensor_infos(new),
        weights_sha256=sha, publisher_id="benchmark",
    )  # fmt: skip
    seconds = Timings()
    payload = seconds.best_of("encode", repeats, lambda: delta_payload(old, new))

    def private_copy() -> tuple[State, set[str]]:
        state = {n: t.clone() for n, t in old.items()}
        return state, set(state)

    def apply_owned(arg: tuple[State, set[str]]) -> State:
        apply_delta(arg[0], arg[1], payload, manifest)
        return arg[0]

    applied = seconds.best_of("apply", repeats, apply_owned, private_copy)
    seconds.best_of("apply_with_copy", repeats, lambda: apply_delta(dict(old), set(), payload, manifest))
    applied_sha = seconds.best_of("weights_hash", 1, lambda: weights_sha256(applied))
    names = sorted(new)
    patches = seconds.best_of(
        "encode_1thread", repeats, lambda: {n: encode_patch(old[n], new[n]) for n in names}
    )

    def apply_loop(state: State) -> None:
        for name, patch in patches.items():
            apply_patch(state[name], patch)

    seconds.best_of("apply_1thread", repeats, apply_loop, lambda: {n: t.clone() for n, t in old.items()})
    changed = sum(int(np.count_nonzero(tensor_bits(old[n]) != tensor_bits(new[n]))) for n in names)
    step = {
        "version": version,
        "full_bytes": full_bytes,
        "changed": changed,
        "density": changed / sum(t.numel() for t in new.values()),
        "delta_bytes": len(payload),
        "bit_exact": applied_sha == sha,
        "seconds": dict(seconds),
        "baseline_bytes": baseline_sizes(old, new),
        "entropy_bits": entropy_bounds(old, new),
    }  # fmt: skip
    logger.info(
        "v%s: density %.4f, delta %s bytes (x%.1f), encode %.2fs, apply %.2fs, exact %s",
        version, step["density"], len(payload), full_bytes / len(payload), seconds["encode"], seconds["apply"],
        step["bit_exact"],
    )  # fmt: skip
    return step


def summarise(args: Settings, params: int, steps: list[dict[str, Any]]) -> dict[str, Any]:
    def mean(get: Callable[[dict[str, Any]], float]) -> float:
        return float(np.mean([get(s) for s in steps]))

    full = mean(lambda s: s["full_bytes"])
    changed = mean(lambda s: s["changed"])
    ours = mean(lambda s: s["delta_bytes"])
    base = {k: mean(lambda s, k=k: s["baseline_bytes"][k]) for k in steps[0]["baseline_bytes"]}
    ent = {k: mean(lambda s, k=k: s["entropy_bits"][k]) for k in steps[0]["entropy_bits"]}
    h_iid = ent["positions_iid"] + ent["values_iid"]
    h_cond = ent["positions_cond"] + ent["values_cond"]
    total_bytes = sum(s["full_bytes"] for s in steps)

    def rate(key: str) -> float:
        return total_bytes / 1e9 / sum(s["seconds"][key] for s in steps)

    return {
        "model": f"Qwen2ForCausalLM (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab})",
        "params": params,
        "optimizer": f"AdamW lr {args.lr:g}, weight decay 0.01, fp32 master weights, bf16 published",
        "deltas_measured": len(steps),
        "aggregate": "mean over the measured consecutive-version deltas (throughput: summed)",
        "density": mean(lambda s: s["density"]),
        "changed_per_step": changed,
        "full_bytes": full,
        "delta_bytes": ours,
        "ratio_vs_full": full / ours,
        "ratio_baseline_a": full / base["a_safetensors"],
        "ratio_baseline_b": full / base["b_safetensors_zstd3"],
        "ratio_baseline_c": full / base["c_int32_bf16_zstd1"],
        "ratio_vs_baseline_c": base["c_int32_bf16_zstd1"] / ours,
        "baseline_bytes": base,
        "entropy_bound_ratio": 8 * full / h_iid,
        "entropy_bound_ratio_conditional": 8 * full / h_cond,
        "bits_per_change": {
            "ours": 8 * ours / changed,
            "entropy_iid": h_iid / changed,
            "entropy_conditional": h_cond / changed,
            "baseline_c": 8 * base["c_int32_bf16_zstd1"] / changed,
        },
        "bit_exact": all(s["bit_exact"] for s in steps),
        "encode_gb_per_s": rate("encode"),
        "apply_gb_per_s": rate("apply"),
        "apply_with_copy_gb_per_s": rate("apply_with_copy"),
        "encode_gb_per_s_1thread": rate("encode_1thread"),
        "apply_gb_per_s_1thread": rate("apply_1thread"),
        "gb_per_cpu_second": {
            k: rate(f"{k}_cpu") for k in ("encode", "apply", "encode_1thread", "apply_1thread")
        },
        "weights_hash_gb_per_s": rate("weights_hash"),
        "codec_threads": codec_workers(),
        "wan_seconds_per_step_1gbps": ours * 8 / 1e9,
        "wan_seconds_full_1gbps": full * 8 / 1e9,
        "load_average_1m": os.getloadavg()[0],
        "per_step": steps,
    }


_D = Settings()


def main(
    json_out: JsonOption = False,
    steps: Annotated[int, typer.Option(help="Optimizer steps (deltas measured).")] = _D.steps,
    lr: Annotated[float, typer.Option(help="AdamW learning rate.")] = _D.lr,
    batch: Annotated[int, typer.Option(help="Sequences per step.")] = _D.batch,
    seq_len: Annotated[int, typer.Option(help="Tokens per sequence.")] = _D.seq_len,
    repeats: Annotated[int, typer.Option(help="Timed runs per step (the best is kept).")] = _D.repeats,
    seed: Annotated[int, typer.Option(help="Seed of the init and the batches.")] = _D.seed,
    vocab: Annotated[int, typer.Option(help="Vocabulary size.")] = _D.vocab,
    hidden: Annotated[int, typer.Option(help="Hidden size.")] = _D.hidden,
    intermediate: Annotated[int, typer.Option(help="MLP width.")] = _D.intermediate,
    layers: Annotated[int, typer.Option(help="Transformer blocks.")] = _D.layers,
    heads: Annotated[int, typer.Option(help="Attention heads.")] = _D.heads,
    kv_heads: Annotated[int, typer.Option(help="Key/value heads.")] = _D.kv_heads,
) -> None:
    """How small and how fast rlbus's weight deltas are, next to the usual baselines, on real steps."""
    args = Settings(steps=steps, lr=lr, batch=batch, seq_len=seq_len, repeats=repeats, seed=seed, vocab=vocab,
                    hidden=hidden, intermediate=intermediate, layers=layers, heads=heads, kv_heads=kv_heads)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    torch.set_num_threads(os.cpu_count() or 1)

    model = build_model(args)
    params = sum(p.numel() for p in model.parameters())
    logger.info("model: %s parameters", params)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    batches = torch.Generator().manual_seed(args.seed + 1)
    previous = bf16_state(model)
    steps = []
    for version in range(1, args.steps + 1):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=batches)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        logger.info("step %s: loss %.4f (%.1fs)", version, loss.item(), time.perf_counter() - start)
        current = bf16_state(model)
        steps.append(measure_step(previous, current, version, args.repeats))
        previous = current
    result = summarise(args, params, steps)
    if json_out:
        print(json.dumps(result))
        return
    for key, value in result.items():
        if key != "per_step":
            print(f"{key:34s} {value}")


if __name__ == "__main__":
    typer.run(main)
