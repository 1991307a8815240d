"""How small and how fast rlbus's trajectory-group codec is, beside JSON, pickle and Arrow IPC + zstd.

    .venv/bin/python -m benchmarks.codec --json

Data (seeded; every parameter is an option and is echoed under ``data``): ``groups`` groups of
``group_size`` samples with ``completion_tokens`` tokens each and a prompt of ``prompt_tokens``.
Token ids are i.i.d. Zipf(``zipf_exponent``) over ``vocab`` ids, the id being the rank (BPE merge
order puts frequent tokens at small ids). Behaviour log-probs are float32 of a mixture: with
probability ``near_zero_fraction`` uniform in [-``near_zero_width``, 0], otherwise -Exponential
(mean ``tail_mean``) clipped at ``tail_floor`` (full-precision mantissas). Token versions start at
one version per sample and step up by one with probability ``version_change_per_token`` at each
token; the loss mask is all ones. Headers are realistic (ids, sampling, 8 rewards, timestamps).

Codecs, each round-tripped and compared bit for bit (headers equal, every column's dtype and
bytes, float32 bits included; ``lossless`` is true only when every round trip of every codec
matched):

* ``rlbus``: ``broker.codec.encode_group`` / ``decode_group`` (format 2; decode validates
  everything, with the consumer's vocabulary); ``rlbus_signed``: the same with an HMAC key
  (signed, and a signature required on decode); ``format1``: the format 1 writer as it was before
  format 2 (raw columns, zstd level 3, validated first), read by today's decoder.
* ``json`` (header and columns as lists, no compression), ``pickle`` (protocol 5, the header
  dict and the arrays) and ``arrow_zstd`` (one Arrow IPC stream per group: one row of list
  columns plus the header JSON, buffers compressed with zstd): no validation, which flatters them.

Figures: ``*_bytes_per_token`` = encoded bytes / completion tokens (prompt tokens are in the
bytes, not in the count). ``*_encode_mtok_per_s`` / ``*_decode_mtok_per_s``: completion tokens
(millions) per second of wall time, one thread (Arrow's thread pool is set to one thread and
unused), the median of ``repeats`` timed runs over all groups, each run repeated to last at least
``min_run_s``; ``*_per_cpu_s`` divides by this thread's CPU time instead (less sensitive to other
load, which ``load_average_1m`` reports). The breakdown ``<column>_bytes_per_token`` compresses
each column's format 2 coded bytes alone with the codec's zstd settings; ``header_bytes_per_token``
is the header frame; ``other_bytes_per_token`` the rest (prefix, column table, frame overheads).

``entropy_floor_bytes_per_token``: what any lossless codec must spend on average on this data,
from the generator's own distributions: the Zipf entropy for each token id (prompt ones included),
the log-probs' entropy as the mean of -log2 P(x) over the generated values (P(x) = density x the
float32 spacing at x, or the mass of the clipped atom), and the binary entropy of a version step
per token.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import statistics
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Annotated, Any

import numpy as np
import pyarrow as pa
import typer
import zstandard

from benchmarks.options import JsonOption
from broker import codec
from broker.columns import encode_column
from broker.schema import COLUMNS, SamplingParams, TrajectoryGroup, TrajectoryHeader
from broker.validate import check_group

KEY = b"benchmark-fleet-key"
Columns = dict[str, np.ndarray]
Decoded = tuple[dict[str, Any], Columns]


@dataclass(frozen=True)
class Data:
    """The generator's parameters (the command-line options)."""

    groups: int = 16
    group_size: int = 8
    completion_tokens: int = 1000
    prompt_tokens: int = 300
    vocab: int = 151_936
    zipf_exponent: float = 1.1
    near_zero_fraction: float = 0.7
    near_zero_width: float = 0.05
    tail_mean: float = 2.0
    tail_floor: float = -20.0
    version_change_per_token: float = 0.002
    seed: int = 0


def zipf_pmf(data: Data) -> np.ndarray:
    p = np.arange(1, data.vocab + 1, dtype=np.float64) ** -data.zipf_exponent
    return p / p.sum()


def make_groups(data: Data) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(data.seed)
    cdf = np.cumsum(zipf_pmf(data))
    n = data.group_size * data.completion_tokens
    groups = []
    for g in range(data.groups):
        def ids(count: int) -> np.ndarray:
            return np.minimum(np.searchsorted(cdf, rng.random(count)), data.vocab - 1).astype(np.int32)

        near = rng.random(n) < data.near_zero_fraction
        tail = np.maximum(-rng.exponential(data.tail_mean, n), data.tail_floor)
        logprobs = np.where(near, -rng.random(n) * data.near_zero_width, tail).astype(np.float32)
        base = 1000 + g // 4
        steps = (rng.random((data.group_size, data.completion_tokens)) < data.version_change_per_token).cumsum(axis=1)
        versions = (base + steps).astype(np.int32).ravel()
        header = TrajectoryHeader(
            run="bench-run-2024", policy="main", group_id=f"p{100_000 + g}/main", prompt_id=f"p{100_000 + g}",
            prompt_key=f"gsm8k/train/{g}", task="math", worker_id=f"worker-{g % 7}", region="eu-west",
            hardware="H100", engine="vllm",
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=data.completion_tokens),
            rewards=[float(x) for x in rng.integers(0, 2, data.group_size)],
            finish_reasons=["stop"] * data.group_size, min_version=int(versions.min()),
            max_version=int(versions.max()), vocab_size=data.vocab, created_at=1_732_000_000.0 + g,
            published_at=1_732_000_042.5 + g,
        )
        groups.append(TrajectoryGroup(
            header=header, prompt_tokens=ids(data.prompt_tokens), completion_tokens=ids(n),
            completion_offsets=np.arange(0, n + 1, data.completion_tokens, dtype=np.int32),
            behaviour_logprobs=logprobs, token_versions=versions, loss_mask=np.ones(n, np.uint8),
        ))
    return groups


# ----------------------------------------------------------------------------- codecs


def _columns(group: TrajectoryGroup) -> Columns:
    return {name: getattr(group, name) for name, _ in COLUMNS}


def _rlbus_decoded(group: TrajectoryGroup) -> Decoded:
    return group.header.model_dump(mode="json"), _columns(group)


def encode_format1(group: TrajectoryGroup) -> bytes:
    """The format 1 writer as it was before format 2: validate, raw columns, zstd level 3."""
    columns = [np.ascontiguousarray(getattr(group, name), dtype=dtype) for name, dtype in COLUMNS]
    check_group(group.header, dict(zip((n for n, _ in COLUMNS), columns)), vocab_size=None)
    header = json.dumps(group.header.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()
    codes = {np.dtype(np.int32): 1, np.dtype(np.float32): 2, np.dtype(np.uint8): 3}
    parts = [struct.pack("<I", len(header)), header, struct.pack("<H", len(columns))]
    for arr in columns:
        parts += [struct.pack("<BQ", codes[arr.dtype], arr.size), arr.astype(arr.dtype.newbyteorder("<")).tobytes()]
    return b"RLBG\x01\x00" + zstandard.ZstdCompressor(level=3, write_checksum=True).compress(b"".join(parts))


def _json_encode(group: TrajectoryGroup) -> bytes:
    obj = {"header": group.header.model_dump(mode="json")} | {k: v.tolist() for k, v in _columns(group).items()}
    return json.dumps(obj, separators=(",", ":")).encode()


def _json_decode(data: bytes) -> Decoded:
    obj = json.loads(data)
    return obj.pop("header"), {name: np.array(obj[name], dtype=dtype) for name, dtype in COLUMNS}


def _pickle_encode(group: TrajectoryGroup) -> bytes:
    return pickle.dumps((group.header.model_dump(mode="json"), _columns(group)), protocol=5)


def _arrow_encode(group: TrajectoryGroup) -> bytes:
    header = json.dumps(group.header.model_dump(mode="json")).encode()
    arrays = [pa.array([header], pa.binary())]
    for v in _columns(group).values():
        arrays.append(pa.ListArray.from_arrays(pa.array([0, v.size], pa.int32()), pa.array(v)))
    batch = pa.RecordBatch.from_arrays(arrays, names=["header"] + [name for name, _ in COLUMNS])
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd", use_threads=False)
    with pa.ipc.new_stream(sink, batch.schema, options=options) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _arrow_decode(data: bytes) -> Decoded:
    reader = pa.ipc.open_stream(data, options=pa.ipc.IpcReadOptions(use_threads=False))
    batch = reader.read_next_batch()
    header = json.loads(batch.column(0)[0].as_py())
    columns = {name: batch.column(i + 1).values.to_numpy(zero_copy_only=False) for i, (name, _) in enumerate(COLUMNS)}
    return header, columns


Codec = tuple[Callable[[TrajectoryGroup], bytes], Callable[[bytes], Any], Callable[[Any], Decoded]]


def codecs(vocab: int) -> dict[str, Codec]:
    """name: (encode, decode, what decode returned as a header dict and columns); only encode and
    decode are timed."""

    def same(decoded: Decoded) -> Decoded:
        return decoded

    def rlbus_decode(data: bytes) -> TrajectoryGroup:
        return codec.decode_group(data, vocab_size=vocab)

    def signed_decode(data: bytes) -> TrajectoryGroup:
        return codec.decode_group(data, vocab_size=vocab, signing_key=KEY, require_signature=True)

    return {
        "rlbus": (codec.encode_group, rlbus_decode, _rlbus_decoded),
        "rlbus_signed": (lambda g: codec.encode_group(g, signing_key=KEY), signed_decode, _rlbus_decoded),
        "format1": (encode_format1, rlbus_decode, _rlbus_decoded),
        "json": (_json_encode, _json_decode, same),
        "pickle": (_pickle_encode, pickle.loads, same),
        "arrow_zstd": (_arrow_encode, _arrow_decode, same),
    }


def _same(group: TrajectoryGroup, decoded: Decoded, signed: bool) -> bool:
    header, columns = decoded
    want = group.header.model_dump(mode="json")
    if signed:  # the signature is what the encoder added
        header = header | {"signature": None}
    if header != want:
        return False
    return all(
        columns[name].dtype == np.dtype(dtype) and columns[name].tobytes() == getattr(group, name).tobytes()
        for name, dtype in COLUMNS
    )


# ----------------------------------------------------------------------------- measurement


def _timed(run: Callable[[], object], repeats: int, min_run_s: float) -> tuple[float, float]:
    """Median wall and thread-CPU seconds of one ``run``, over ``repeats`` timed runs."""
    start = time.perf_counter()
    run()
    loops = max(1, math.ceil(min_run_s / max(time.perf_counter() - start, 1e-9)))
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(loops):
            run()
        cpus.append((time.thread_time() - cpu) / loops)
        walls.append((time.perf_counter() - wall) / loops)
    return statistics.median(walls), statistics.median(cpus)


def measure(groups: list[TrajectoryGroup], vocab: int, repeats: int, min_run_s: float) -> tuple[dict[str, float], bool]:
    tokens = sum(len(g.completion_tokens) for g in groups)
    out: dict[str, float] = {}
    lossless = True
    for name, (encode, decode, as_dicts) in codecs(vocab).items():
        blobs = [encode(g) for g in groups]
        ok = all(_same(g, as_dicts(decode(b)), signed=name == "rlbus_signed") for g, b in zip(groups, blobs))
        lossless &= ok
        enc_wall, enc_cpu = _timed(lambda: [encode(g) for g in groups], repeats, min_run_s)
        dec_wall, dec_cpu = _timed(lambda: [decode(b) for b in blobs], repeats, min_run_s)
        prefix = "" if name == "rlbus" else f"{name}_"
        out |= {
            f"{prefix}bytes_per_token": round(sum(map(len, blobs)) / tokens, 4),
            f"{prefix}encode_mtok_per_s": round(tokens / enc_wall / 1e6, 2),
            f"{prefix}decode_mtok_per_s": round(tokens / dec_wall / 1e6, 2),
            f"{prefix}encode_mtok_per_cpu_s": round(tokens / enc_cpu / 1e6, 2),
            f"{prefix}decode_mtok_per_cpu_s": round(tokens / dec_cpu / 1e6, 2),
            f"{prefix}lossless": ok,
        }
    return out, lossless


BREAKDOWN = {
    "prompt_tokens": "prompt_token_ids", "completion_tokens": "token_ids", "completion_offsets": "offsets",
    "behaviour_logprobs": "logprobs", "token_versions": "versions", "loss_mask": "loss_mask",
}


def breakdown(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """Bytes per token of each column's format 2 coding, compressed alone as the codec does."""
    params = zstandard.ZstdCompressionParameters.from_level(
        codec.GROUP_ZSTD_LEVEL, min_match=codec.GROUP_ZSTD_MIN_MATCH, write_checksum=1
    )
    zstd = zstandard.ZstdCompressor(compression_params=params)
    tokens = sum(len(g.completion_tokens) for g in groups)
    sizes = dict.fromkeys(BREAKDOWN.values(), 0) | {"header": 0}
    for g in groups:
        for name, _ in COLUMNS:
            stream = zstd.compressobj()
            parts = encode_column(name, getattr(g, name))[1]
            out = [stream.compress(p) + stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK) for p in parts]
            sizes[BREAKDOWN[name]] += len(b"".join(out) + stream.flush())
        header = json.dumps(g.header.model_dump(mode="json"), sort_keys=True, separators=(",", ":")).encode()
        sizes["header"] += len(zstd.compress(header))
    total = sum(len(codec.encode_group(g)) for g in groups)
    result = {f"{k}_bytes_per_token": round(v / tokens, 4) for k, v in sizes.items()}
    return result | {"other_bytes_per_token": round((total - sum(sizes.values())) / tokens, 4)}


def entropy_floor(data: Data, groups: list[TrajectoryGroup]) -> dict[str, float]:
    pmf = zipf_pmf(data)
    id_bits = float(-(pmf * np.log2(pmf)).sum())
    x = np.concatenate([g.behaviour_logprobs for g in groups]).astype(np.float64)
    q, w, mu = data.near_zero_fraction, data.near_zero_width, data.tail_mean
    density = (1 - q) / mu * np.exp(x / mu) + np.where(x >= -w, q / w, 0.0)
    prob = density * np.abs(np.spacing(x.astype(np.float32))).astype(np.float64)
    prob = np.where(x == np.float32(data.tail_floor), (1 - q) * math.exp(data.tail_floor / mu), prob)
    logprob_bits = float(np.mean(-np.log2(prob[x != 0])))
    p = data.version_change_per_token
    version_bits = -(p * math.log2(p) + (1 - p) * math.log2(1 - p)) if 0 < p < 1 else 0.0
    per_token = {
        "token_ids": id_bits / 8,
        "prompt_token_ids": id_bits / 8 * data.prompt_tokens / (data.group_size * data.completion_tokens),
        "logprobs": logprob_bits / 8,
        "versions": version_bits / 8,
    }
    result = {f"{k}_entropy_floor_bytes_per_token": round(v, 4) for k, v in per_token.items()}
    return {"entropy_floor_bytes_per_token": round(sum(per_token.values()), 4)} | result


def main(
    json_out: JsonOption = False,
    repeats: Annotated[int, typer.Option(help="Timed runs per figure (the median is kept).")] = 7,
    min_run_s: Annotated[float, typer.Option(help="Each timed run repeats its work to last at least this.")] = 0.2,
    groups: Annotated[int, typer.Option(help="Groups encoded per run.")] = Data.groups,
    group_size: Annotated[int, typer.Option(help="Samples per group (G).")] = Data.group_size,
    completion_tokens: Annotated[int, typer.Option(help="Tokens per completion.")] = Data.completion_tokens,
    prompt_tokens: Annotated[int, typer.Option(help="Tokens per prompt.")] = Data.prompt_tokens,
    vocab: Annotated[int, typer.Option(help="Vocabulary size.")] = Data.vocab,
    zipf_exponent: Annotated[float, typer.Option(help="Exponent of the token ids' Zipf law.")] = Data.zipf_exponent,
    near_zero_fraction: Annotated[float, typer.Option(help="Share of log-probs near 0.")] = Data.near_zero_fraction,
    near_zero_width: Annotated[float, typer.Option(help="Those are uniform in [-width, 0].")] = Data.near_zero_width,
    tail_mean: Annotated[float, typer.Option(help="Mean of the others' exponential tail.")] = Data.tail_mean,
    tail_floor: Annotated[float, typer.Option(help="Tail clipped at this log-prob.")] = Data.tail_floor,
    version_change_per_token: Annotated[
        float, typer.Option(help="Chance of a version step at each token.")
    ] = Data.version_change_per_token,
    seed: Annotated[int, typer.Option(help="Seed of the generator.")] = Data.seed,
) -> None:
    """How small and how fast rlbus's trajectory-group codec is, beside JSON, pickle and Arrow IPC + zstd."""
    data = Data(groups, group_size, completion_tokens, prompt_tokens, vocab, zipf_exponent, near_zero_fraction,
                near_zero_width, tail_mean, tail_floor, version_change_per_token, seed)
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    batch = make_groups(data)
    figures, lossless = measure(batch, vocab, repeats, min_run_s)
    result = {"lossless": lossless} | figures | breakdown(batch) | entropy_floor(data, batch) | {
        "tokens_per_group": group_size * completion_tokens,
        "threads": 1,
        "timing": f"one thread; median of {repeats} runs of >= {min_run_s} s; per_s: wall clock, per_cpu_s: thread CPU",
        "load_average_1m": round(os.getloadavg()[0], 2),
        "zstandard": zstandard.__version__,
        "pyarrow": pa.__version__,
        "data": asdict(data),
    }
    if json_out:
        print(json.dumps(result))
        return
    columns = ("B/token", "enc Mtok/s", "dec Mtok/s", "enc /cpu-s", "dec /cpu-s")
    print(f"{'codec':14s} {columns[0]:>8s} " + " ".join(f"{c:>11s}" for c in columns[1:]) + " lossless")
    for name in codecs(vocab):
        p = "" if name == "rlbus" else f"{name}_"
        print(f"{name:14s} {result[p + 'bytes_per_token']:8.3f} {result[p + 'encode_mtok_per_s']:11.2f} "
              f"{result[p + 'decode_mtok_per_s']:11.2f} {result[p + 'encode_mtok_per_cpu_s']:11.2f} "
              f"{result[p + 'decode_mtok_per_cpu_s']:11.2f} {result[p + 'lossless']}")
    for key, value in result.items():
        if key.endswith("_bytes_per_token") and not key.startswith(tuple(f"{n}_" for n in codecs(vocab))):
            print(f"{key:44s} {value}")
    for key in ("lossless", "timing", "load_average_1m"):
        print(f"{key:44s} {result[key]}")


if __name__ == "__main__":
    typer.run(main)
