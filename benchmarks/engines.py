"""The two rollout engines on the machine at hand: the same checkpoint, prompts and sampling through
``TorchEngine`` (the baseline) and ``VLLMEngine``, each in a process of its own, measured in one run.

    .venv/bin/python -m benchmarks.engines --json               # the default size for the device
    .venv/bin/python -m benchmarks.engines --size ci --json     # the model of configs/ci.toml

A Qwen2-shaped checkpoint is built from scratch (``rlbus.examples.scratch``) and loaded by each
engine's own loading code (``producers.engines.build_engine``). Sizes: ``ci`` (the model of
configs/ci.toml: hidden 128, 2 layers, a character vocabulary), ``cpu`` (the CPU default: 58 M
parameters, hidden 512, 8 layers, GQA 8/4, vocabulary 32,000), ``0.5b`` (the GPU default: Qwen2.5-0.5B's
shape, vocabulary 151,936, tied).

Per engine: ``start_s`` (building the engine: loading, and for vLLM its processes, KV cache and
compilation), ``ttft_s`` (time to first token: a generation of one token for the whole batch,
i.e. the prefill), ``tokens_per_s`` (generated tokens per second of a generation of ``--prompts``
prompts × ``--samples`` samples × up to ``--tokens`` new tokens at temperature 1, the best of
``--repeats`` after one warm-up), ``swap_s`` (the median time of ``load_weights`` of a full,
perturbed state dict, as a worker receives one from the weight store, ``--swaps`` times; for vLLM
this includes writing it to shared memory and its in-place reload) and ``rss_mib`` (resident memory
of the engine's process and its children at the end). The engines run with every core of the
machine (the torch engine with torch's threads, vLLM bound to all cores).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from benchmarks.options import JsonOption

SIZES: dict[str, dict[str, Any]] = {
    "cpu": dict(hidden_size=512, layers=8, heads=8, kv_heads=4, intermediate_size=1536, vocab_size=32_000),
    "0.5b": dict(hidden_size=896, layers=24, heads=14, kv_heads=2, intermediate_size=4864, vocab_size=151_936,
                 tie_embeddings=True),
}


def build(size: str, out: Path) -> Path:
    """The checkpoint of ``size`` under ``out``."""
    path = out / f"qwen2-{size}"
    if size == "ci":
        from rlbus.examples.addition import build_model

        return build_model(path, arch="qwen2", hidden_size=128, layers=2, heads=4, intermediate_size=512, seed=0)
    from rlbus.examples.scratch import build_checkpoint, train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer([f"{a} plus {b} is {a + b}." for a in range(40) for b in range(40)], vocab_size=300)
    return build_checkpoint(path, tokenizer, arch="qwen2", max_position_embeddings=1024, **SIZES[size])


def _tree_rss_mib(pid: int | None = None) -> float:
    """Resident memory of a process and all its descendants (from /proc), MiB."""
    pid = pid or os.getpid()
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                    for c in (task / "children").read_text().split()]
    except OSError:  # it ended meanwhile
        return 0.0
    rss = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 1024
    return rss + sum(_tree_rss_mib(c) for c in children)


def measure(kind: str, model_dir: Path, prompts: int, samples: int, tokens: int, repeats: int, swaps: int,
            dtype: str) -> dict[str, Any]:
    """One engine's figures (runs in its own process)."""
    import asyncio

    import torch

    from broker.schema import SamplingParams
    from producers.config import EngineConfig
    from producers.engines import build_engine

    t0 = time.perf_counter()
    engine = build_engine(EngineConfig(type=kind, compute_dtype=dtype, seed=0), model_dir)
    start_s = time.perf_counter() - t0
    tok = engine.tokenizer
    batch = [tok(f"{i} plus {3 * i % 40} is")["input_ids"] for i in range(prompts)]
    first = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=1)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=tokens)
    asyncio.run(engine.generate_batch(batch, samples, sampling))  # warm-up
    t0 = time.perf_counter()
    asyncio.run(engine.generate_batch(batch, samples, first))
    ttft_s = time.perf_counter() - t0
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = asyncio.run(engine.generate_batch(batch, samples, sampling))
        rates.append(sum(len(r.tokens) for group in out for r in group) / (time.perf_counter() - t0))
    from safetensors.torch import load_file

    base = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        base.update(load_file(str(file)))
    swap_times = []
    for v in range(1, swaps + 1):
        state = {k: t + 0.01 * v for k, t in base.items()}
        t0 = time.perf_counter()
        asyncio.run(engine.load_weights(state, v))
        swap_times.append(time.perf_counter() - t0)
    generated = asyncio.run(engine.generate_batch(batch[:1], 1, sampling))[0][0]
    assert generated.versions == [swaps] * len(generated.tokens), "the last swap is not what generates"
    rss = _tree_rss_mib()
    engine.close()
    return {"start_s": round(start_s, 2), "ttft_s": round(ttft_s, 3), "tokens_per_s": round(max(rates), 1),
            "tokens_per_s_runs": [round(r, 1) for r in rates], "swap_s": round(statistics.median(swap_times), 3),
            "rss_mib": round(rss), "threads": torch.get_num_threads()}


def _in_process(kind: str, args: list[str]) -> dict[str, Any] | None:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        run = subprocess.run([sys.executable, "-m", "benchmarks.engines", "--one", kind, "--out", out.name, *args],
                             cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)
        if run.returncode != 0:
            print(f"{kind} engine failed:\n{run.stderr[-3000:]}", file=sys.stderr)
            return None
        return json.loads(Path(out.name).read_text())


def main(
    size: Annotated[str, typer.Option(help="ci, cpu or 0.5b; default: cpu on a CPU, 0.5b on a GPU.")] = "",
    prompts: Annotated[int, typer.Option(help="Prompts per generation.")] = 16,
    samples: Annotated[int, typer.Option(help="Samples per prompt.")] = 8,
    tokens: Annotated[int, typer.Option(help="New tokens per sample (at most).")] = 64,
    repeats: Annotated[int, typer.Option(help="Timed generations per engine (the best counts).")] = 2,
    swaps: Annotated[int, typer.Option(help="Weight updates per engine (the median counts).")] = 5,
    dtype: Annotated[str, typer.Option(help="float32 or bfloat16; default: float32 on a CPU, bfloat16 on a GPU.")] = "",
    json_out: JsonOption = False,
    one: Annotated[str, typer.Option(hidden=True)] = "",
    out: Annotated[str, typer.Option(hidden=True)] = "",
    model_dir: Annotated[str, typer.Option(hidden=True)] = "",
) -> None:
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = size or ("cpu" if device == "cpu" else "0.5b")
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    if one:
        Path(out).write_text(json.dumps(measure(one, Path(model_dir), prompts, samples, tokens, repeats, swaps, dtype)))
        return
    with tempfile.TemporaryDirectory(prefix="rlbus-bench-engines-") as tmp:
        path = build(size, Path(tmp))
        from transformers import AutoModelForCausalLM

        params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
        args = ["--prompts", str(prompts), "--samples", str(samples), "--tokens", str(tokens), "--repeats",
                str(repeats), "--swaps", str(swaps), "--dtype", dtype, "--model-dir", str(path)]
        torch_figures = _in_process("torch", args)
        vllm_figures = _in_process("vllm", args)
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores)"
    result = {
        "device": name, "size": size, "params": params, "dtype": dtype,
        "workload": {"prompts": prompts, "samples": samples, "max_new_tokens": tokens},
        "torch_tokens_per_s": torch_figures and torch_figures["tokens_per_s"],
        "vllm_tokens_per_s": vllm_figures and vllm_figures["tokens_per_s"],
        "vllm_over_torch": (round(vllm_figures["tokens_per_s"] / torch_figures["tokens_per_s"], 2)
                            if torch_figures and vllm_figures else None),
        "torch_swap_s": torch_figures and torch_figures["swap_s"],
        "vllm_swap_s": vllm_figures and vllm_figures["swap_s"],
        "torch": torch_figures, "vllm": vllm_figures,
    }
    if json_out:
        print(json.dumps(result, indent=1))
        return
    print(f"{name}, {size} ({params / 1e6:.1f} M parameters, {dtype}), {prompts} prompts × {samples} samples × "
          f"{tokens} tokens")
    print(f"{'':8}{'tokens/s':>10}{'ttft s':>9}{'swap s':>9}{'start s':>9}{'RSS MiB':>9}")
    for kind, fig in (("torch", torch_figures), ("vllm", vllm_figures)):
        if fig is None:
            print(f"{kind:8}failed (see above)")
        else:
            print(f"{kind:8}{fig['tokens_per_s']:>10.0f}{fig['ttft_s']:>9.3f}{fig['swap_s']:>9.3f}{fig['start_s']:>9.1f}"
                  f"{fig['rss_mib']:>9}")
    if result["vllm_over_torch"]:
        print(f"vLLM / torch: {result['vllm_over_torch']}×")


if __name__ == "__main__":
    typer.run(main)
