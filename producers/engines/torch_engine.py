"""``TorchEngine``: the ``Engine`` protocol (``producers.engines.base``) over a Hugging Face causal LM,
with a KV-cached decoding loop in this process; in-flight weight updates swap between two decoding steps.
A mixture-of-experts policy's results carry the experts its routers selected (``producers.engines.moe``)."""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from broker.schema import SamplingParams
from producers.engines.base import DTYPES, BatchedEngine, GenerationResult, refuse_mismatch, stop_token_ids
from producers.engines.moe import Routers, find_routers

logger = logging.getLogger(__name__)


def sample_next(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of ``logits`` [B, V]; return (tokens [B], behaviour log-probs [B])."""
    logits = logits.float()
    if sampling.temperature == 0.0:
        logp = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
    else:
        logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
        if sampling.top_p < 1.0:  # the nucleus, renormalised: the distribution sampled from
            sorted_logp, order = logp.sort(dim=-1, descending=True)
            sorted_p = sorted_logp.exp()
            mass_before = sorted_p.cumsum(dim=-1) - sorted_p
            sorted_logp = sorted_logp.masked_fill(mass_before >= sampling.top_p, float("-inf"))
            logp = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_logp)
            logp = logp - torch.logsumexp(logp, dim=-1, keepdim=True)
        tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


class TorchEngine(BatchedEngine):
    """Batched temperature/top-p sampling over an HF causal LM with a KV cache."""

    name = "torch"

    def __init__(
        self,
        model_dir: Path,
        *,
        compute_dtype: str = "float32",
        device: str = "auto",
        seed: int | None = None,
        version: int = 0,
    ) -> None:
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   "cpu" if device == "auto" else device)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=DTYPES[compute_dtype], local_files_only=True
        ).to(self.device)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.vocab_size: int = int(self.model.config.vocab_size)
        self.max_context_tokens: int = int(getattr(self.model.config, "max_position_embeddings", None) or 2048)
        self.version = version
        self._stop_ids = torch.tensor(stop_token_ids(self.model.config, self.tokenizer), device=self.device)
        self._pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self._lock = threading.Lock()  # held for one decoding step or one weight swap
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed if seed is not None else secrets.randbits(63))
        self._abort_epoch = 0
        self.step_hook: Callable[[int], None] | None = None
        """Called in the decoding thread after step ``i`` (outside the lock); for tests and probes."""
        self._routers = _recordable_routers(self.model)
        self.routing_shape = None if self._routers is None else self._routers.shape
        self.kv_cache = True
        """Decode with a KV cache (the fast path); False runs the whole sequence every step."""
        self.kv_cache = self._kv_cache_agrees()

    def _run(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> list[GenerationResult]:
        """The decoding loop. Tokens, log-probs and lengths stay on the device until the end (one
        transfer per call); rows that stopped leave the batch at the next check, every step on a
        CPU (where leaving saves compute and a check costs nothing) and every 8 steps on a GPU
        (where a check waits for the device). A mixture of experts records each step's routing at the
        position that predicts the new token, and the prompt pass's at the prompts' positions."""
        epoch = self._abort_epoch
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row's last token is its newest
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        seq, seq_positions = ids, positions  # the whole sequences, for the forward without a cache
        total, limit = len(prompts) * n, sampling.max_new_tokens
        out_tokens = torch.full((total, limit), self._pad_id, dtype=torch.long, device=self.device)
        out_logp = torch.zeros((total, limit), dtype=torch.float32, device=self.device)
        lengths = torch.full((total,), limit, dtype=torch.long, device=self.device)
        stopped_at = torch.zeros(total, dtype=torch.bool, device=self.device)  # sampled a stop token
        step_versions: list[int] = []
        aborted: list[int] = []
        rows = torch.arange(total, device=self.device)  # sample index of each batch row
        cache = DynamicCache() if self.kv_cache else None
        check_every = 1 if self.device.type == "cpu" else 8
        routers = self._routers
        out_experts = None if routers is None else torch.full(
            (total, limit, routers.shape.layers, routers.shape.top_k), -1, dtype=torch.int16, device=self.device)
        prompt_experts = experts = None  # [prompts, width - 1, layers, top_k]; the step's [rows, layers, top_k]
        for step in range(limit):
            if self._abort_epoch != epoch:
                live = rows[~stopped_at[rows]]
                lengths[live] = step
                aborted = live.tolist()
                break
            recording = contextlib.nullcontext() if routers is None else routers.record()
            with self._lock, torch.inference_mode(), recording as recorder:
                step_versions.append(self.version)
                batch_rows = ids.shape[0]
                if cache is not None:
                    out = self.model(
                        input_ids=ids, attention_mask=mask, position_ids=positions,
                        past_key_values=cache, use_cache=True, logits_to_keep=1,
                    )
                else:  # the general path: the whole sequence every step
                    out = self.model(input_ids=seq, attention_mask=mask, position_ids=seq_positions,
                                     use_cache=False, logits_to_keep=1)
                logits = out.logits[:, -1, :]
                if recorder is not None:  # [rows, positions, layers, top_k]: the newest position's, the prompts'
                    experts = recorder.take().unflatten(0, (batch_rows, -1)).to(torch.int16)
                    if step == 0:
                        prompt_experts = experts[:, :-1]
                    experts = experts[:, -1]
                if step == 0 and n > 1:  # prefill once per prompt, then fan out to n samples
                    experts = None if experts is None else experts.repeat_interleave(n, dim=0)
                    if cache is not None:
                        cache.batch_repeat_interleave(n)
                    logits = logits.repeat_interleave(n, dim=0)
                    mask = mask.repeat_interleave(n, dim=0)
                    positions = positions.repeat_interleave(n, dim=0)
                    seq, seq_positions = seq.repeat_interleave(n, dim=0), seq_positions.repeat_interleave(n, dim=0)
                next_tokens, next_logp = sample_next(logits, sampling, self._generator)
            out_tokens[rows, step] = next_tokens
            out_logp[rows, step] = next_logp
            if out_experts is not None:
                out_experts[rows, step] = experts
            ending = torch.isin(next_tokens, self._stop_ids) & ~stopped_at[rows]
            lengths[rows] = torch.where(ending, step + 1, lengths[rows])
            stopped_at[rows] |= ending
            if (step + 1) % check_every == 0 or step + 1 == limit:
                alive = ~stopped_at[rows]
                if not bool(alive.all()):
                    keep = alive.nonzero().squeeze(-1)
                    if keep.numel() == 0:
                        break
                    if cache is not None:
                        cache.batch_select_indices(keep)
                    rows, next_tokens = rows[keep], next_tokens[keep]
                    mask, positions = mask[keep], positions[keep]
                    seq, seq_positions = seq[keep], seq_positions[keep]
            ids = next_tokens[:, None]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            seq, seq_positions = torch.cat([seq, ids], dim=1), torch.cat([seq_positions, positions], dim=1)
            if self.step_hook is not None:
                self.step_hook(step)
        token_rows, logp_rows = out_tokens.tolist(), out_logp.tolist()
        ends, stops, gone = lengths.tolist(), stopped_at.tolist(), set(aborted)
        tokens = [token_rows[i][: ends[i]] for i in range(total)]
        texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        results = [
            GenerationResult(tokens[i], logp_rows[i][: ends[i]], step_versions[: ends[i]],
                             "abort" if i in gone else "stop" if stops[i] else "length", texts[i])
            for i in range(total)
        ]
        if out_experts is not None:
            _attach_routing(results, out_experts, prompt_experts, prompts, n)
        return results

    def _kv_cache_agrees(self, steps: int = 4) -> bool:
        """Whether cached decoding gives this architecture the log-probs of a plain forward: a few
        greedy steps on a probe prompt, compared with one forward over the whole sequence. When it
        does not (or fails), the engine decodes without the cache and says so."""
        probe = self.tokenizer("The 12 cats, 3+4=7.", add_special_tokens=False)["input_ids"][:8] or [self._pad_id]
        greedy = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=steps)
        kind = type(self.model).__name__
        try:
            (result,) = self._run([probe], 1, greedy)
            seq = torch.tensor([probe + result.tokens], device=self.device)
            with torch.inference_mode():
                full = torch.log_softmax(self.model(input_ids=seq, use_cache=False).logits[0].float(), dim=-1)
            at = torch.arange(len(probe) - 1, seq.shape[1] - 1, device=self.device)
            plain = full[at, seq[0, at + 1]]
            gap = float((plain - torch.tensor(result.logprobs, device=self.device)).abs().max())
        except Exception as exc:  # any failure of the fast path on this architecture means: do not use it
            logger.warning("%s: decoding with a KV cache failed (%s); decoding without it (slower, same log-probs)",
                           kind, exc)
            return False
        tolerance = 1e-3 if self.model.dtype == torch.float32 else 5e-2
        if gap > tolerance:
            logger.warning("%s: log-probs with a KV cache differ from the plain forward by %.2g; decoding without "
                           "the cache (slower, same log-probs)", kind, gap)
            return False
        return True

    # ---- weights ----------------------------------------------------------------------------
    def _swap(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        own = self.model.state_dict()
        unexpected = sorted(set(state_dict) - set(own))
        seen: dict[int, str] = {}
        required = []
        for key, tensor in own.items():  # a tied weight may be supplied under either name
            if tensor.data_ptr() not in seen:
                seen[tensor.data_ptr()] = key
                required.append(key)
        missing = [k for k in required if k not in state_dict and not _tied_supplied(own, k, state_dict)]
        bad_shape = [k for k in state_dict if k in own and tuple(state_dict[k].shape) != tuple(own[k].shape)]
        refuse_mismatch(version, unexpected, missing, bad_shape)
        with self._lock, torch.no_grad():
            for key, tensor in state_dict.items():
                own[key].copy_(tensor)
            previous, self.version = self.version, version
        logger.info("weights swapped from version %d to %d", previous, version)

    def close(self) -> None:
        """Nothing to stop: the model lives in this process."""


def _recordable_routers(model: torch.nn.Module) -> Routers | None:
    """The routers whose choices the engine records; None for a dense model, and for a mixture of experts
    whose router rlbus cannot replay: it generates all the same, and the trainer routes live."""
    try:
        return find_routers(model)
    except ValueError as exc:  # generation does not need the routing: go on without it
        logger.warning("%s; generating without recording the routing", exc)
        return None


def _attach_routing(results: list[GenerationResult], out_experts: torch.Tensor, prompt_experts: torch.Tensor | None,
                    prompts: list[list[int]], n: int) -> None:
    """Each result's routing (its tokens' rows) and its prompt's (positions 0..P-2, left padding cut off;
    -1 when the prompt pass did not run, an abort before it)."""
    recorded = out_experts.cpu().numpy()
    width = max(len(p) for p in prompts)
    layers, top_k = recorded.shape[2:]
    passed = None if prompt_experts is None else prompt_experts.cpu().numpy()
    by_prompt = [np.full((len(p) - 1, layers, top_k), -1, dtype=np.int16) if passed is None else
                 np.ascontiguousarray(passed[i, width - len(p):]) for i, p in enumerate(prompts)]
    for i, result in enumerate(results):
        result.routing = recorded[i, : len(result.tokens)].copy()
        result.prompt_routing = by_prompt[i // n]


def _tied_supplied(own: Mapping[str, torch.Tensor], key: str, given: Mapping[str, torch.Tensor]) -> bool:
    ptr = own[key].data_ptr()
    return any(k in given for k, t in own.items() if k != key and t.data_ptr() == ptr)
