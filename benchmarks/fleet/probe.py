"""Costs measured on this machine by probes of its own: the CPU contention of two busy threads, and the
trainer intake's decoding of one group."""

from __future__ import annotations

import sys
import time

PROBE = """
import sys, time, torch
torch.set_num_threads(1)
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, batch_first=True)
x = torch.randn(32, 16, 128)
def once():
    layer(x).square().mean().backward()
for _ in range(5):
    once()
if sys.argv[1] == "spin":
    end = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
        once()
else:
    times = []
    for _ in range(int(sys.argv[2])):
        t = time.perf_counter()
        for _ in range(20):
            once()
        times.append(time.perf_counter() - t)
    print(sorted(times)[len(times) // 2])
"""


def measure_contention(rounds: int = 15) -> dict:
    """The slowdown of one CPU-bound thread (a transformer layer's forward and backward, one torch
    thread, as the trainer and the workers run) while a second one runs beside it, against alone:
    ``contention`` = t_beside / t_alone − 1 (0 on cores that share nothing; a small VM's vCPUs share
    physical cores and caches). Run it on a quiet machine."""
    import subprocess

    def timed() -> float:
        out = subprocess.run([sys.executable, "-c", PROBE, "time", str(rounds)], capture_output=True, text=True,
                             check=True)
        return float(out.stdout.strip())

    alone = timed()
    spinner = subprocess.Popen([sys.executable, "-c", PROBE, "spin", str(10 * alone * rounds / 20 + 30)])
    try:
        time.sleep(3.0)  # the spinner is past its start-up
        beside = timed()
    finally:
        spinner.kill()
        spinner.wait()
    return {"alone_s": round(alone, 4), "beside_s": round(beside, 4), "contention": round(beside / alone - 1.0, 3)}


def intake_cost(tokens_per_group: int, group_size: int = 8, seconds: float = 2.0) -> float:
    """CPU seconds the trainer's intake spends decoding and checking one group of this shape
    (``decode_group`` as the intake calls it; the Kafka client's own work is left out)."""
    import numpy as np

    from broker.codec import decode_group, encode_group
    from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader

    rng, n = np.random.default_rng(0), max(group_size, tokens_per_group)
    per = n // group_size
    values = []
    for i in range(64):
        header = TrajectoryHeader(
            run="probe", policy="main", group_id=f"g{i}", prompt_id=f"p{i}", task="addition", worker_id="worker-0",
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=per), rewards=[1.0, 0.0] * (group_size // 2),
            finish_reasons=["stop"] * group_size, min_version=1, max_version=1, vocab_size=64, created_at=time.time())
        values.append(encode_group(TrajectoryGroup(
            header=header, prompt_tokens=rng.integers(0, 64, 10).astype(np.int32),
            completion_tokens=rng.integers(0, 64, per * group_size).astype(np.int32),
            completion_offsets=np.arange(0, per * group_size + 1, per, dtype=np.int32),
            behaviour_logprobs=-rng.random(per * group_size).astype(np.float32),
            token_versions=np.ones(per * group_size, np.int32))))
    count, start = 0, time.process_time()
    while time.process_time() - start < seconds:
        decode_group(values[count % len(values)], vocab_size=64)
        count += 1
    return (time.process_time() - start) / count
