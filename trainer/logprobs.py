"""Per-token log-probabilities (and entropy) of a policy at the tokens a step trains on, without
``[tokens × vocab]`` logits.

``PolicyModel`` wraps a Hugging Face causal LM. Its forward runs the decoder once over a batch (each
group's prompt once, with the shared-prefix forward), gathers the hidden states of the positions that
predict a trained token, and projects them through the LM head a chunk of rows at a time
(``chunked_head_logprobs``): the forward keeps each chunk's log-sum-exp only, the backward recomputes
the chunk's logits. The head's peak memory is a few chunks of float32 logits, whatever the batch.

It is also the unit the trainer shards (``trainer.distributed``): its forward is the root forward, so
FSDP2 gathers the embeddings, final norm and LM head around it.

A mixture-of-experts batch's recorded routing (``TrainBatch.routing``) is replayed in every decoder call,
each with its slice of the plan (``producers.engines.moe``), also in the recomputation of checkpointed layers.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer

from producers.engines.moe import checkpoint_contexts, replay, routers_in

if TYPE_CHECKING:
    from trainer.batch import TrainBatch

logger = logging.getLogger(__name__)

MIB = 1 << 20


class _ChunkedHead(torch.autograd.Function):
    """log softmax(head(h) / T)[target] and the entropy of that distribution, ``rows`` hidden states at
    a time. ``head(h) = W h (+ b)``, soft-capped as ``cap · tanh(z / cap)`` when ``cap`` is set."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, cap, rows, dtype):
        lp = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(lp)
        lse = torch.empty_like(lp)
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], rows):
                part = slice(start, start + rows)
                logits, _ = _logits(hidden[part], w, bias, temperature, cap, dtype)
                # One exp over the chunk gives the log-sum-exp and the entropy: H = lse − Σ e·l / Σ e.
                top = logits.max(dim=-1, keepdim=True).values
                e = torch.sub(logits, top).exp_()
                total = e.sum(-1)
                lse[part] = top.squeeze(-1) + total.log()
                lp[part] = logits.gather(1, targets[part, None]).squeeze(1) - lse[part]
                entropy[part] = lse[part] - e.mul_(logits).sum(-1) / total
                del logits, e
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.settings = (temperature, cap, rows, dtype)
        ctx.mark_non_differentiable(entropy)
        return lp, entropy

    @staticmethod
    def backward(ctx, grad_lp, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        temperature, cap, rows, dtype = ctx.settings
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        w = weight.to(dtype)
        upstream = grad_lp.float() / temperature  # through the 1/T of the logits
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], rows):
                part = slice(start, start + rows)
                logits, capped = _logits(hidden[part], w, bias, temperature, cap, dtype)
                # d lp / d logits = onehot(target) − softmax; then through the soft cap.
                grad = logits.sub_(lse[part, None]).exp_().mul_(-upstream[part, None])
                grad.scatter_add_(1, targets[part, None], upstream[part, None])
                if capped is not None:
                    grad.mul_(1.0 - capped.pow_(2))
                del logits, capped
                if grad_hidden is not None:
                    grad_hidden[part] = (grad.to(dtype) @ w).to(hidden.dtype)
                grad_weight.add_(grad.t().to(dtype) @ hidden[part].to(dtype))
                if grad_bias is not None:
                    grad_bias.add_(grad.sum(0))
                del grad
        grad_weight = grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _logits(hidden, w, bias, temperature, cap, dtype):
    """Float32 logits / T of one chunk (a new tensor), and tanh of the capped pre-logits (None
    without a cap)."""
    z = (hidden.to(dtype) @ w.t()).float()
    if bias is not None:
        z.add_(bias.float())
    capped = None
    if cap:
        capped = torch.tanh(z / cap)
        z = capped * cap
    if temperature != 1.0:
        z.div_(temperature)
    return z, capped


def chunked_head_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    chunk_mib: float = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies [M] (float32) of ``targets`` [M] under ``softmax(head(hidden) / T)``,
    ``hidden`` [M, H]. Logits are made ``chunk_mib`` MiB of float32 at a time and never kept: the
    backward recomputes them. ``chunk_mib = 0``: all rows at once with plain autograd (the logits are
    kept for the backward, as a model's own forward does). Under autocast the projection runs in the
    autocast dtype, as ``head`` would."""
    device = hidden.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else head.weight.dtype
    temperature = float(temperature) if temperature > 0 else 1.0
    if hidden.shape[0] == 0:
        # No trained token: still a result on the graph of the hidden states and the head, so that the
        # backward runs through every layer (each one a collective on a sharded model).
        empty = hidden.new_zeros(0, dtype=torch.float32) + 0.0 * (hidden.sum() + head.weight.sum())
        return empty, empty.detach()
    if chunk_mib <= 0:
        logits, _ = _logits(hidden, head.weight.to(dtype), head.bias, temperature, softcap, dtype)
        logp = torch.log_softmax(logits, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1).detach()
        return logp.gather(1, targets[:, None]).squeeze(1), entropy
    rows = max(1, int(chunk_mib * MIB // (4 * head.weight.shape[0])))
    return _ChunkedHead.apply(hidden, head.weight, head.bias, targets, temperature, softcap, rows, dtype)


class _RecordingCache(DynamicCache):
    """The prompt pass's cache: each layer records its keys and values from scratch on every call, so
    a forward recomputed under activation checkpointing records the same thing again."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        while self.layer_class_to_replicate is not None and len(self.layers) <= layer_idx:
            self.layers.append(self.layer_class_to_replicate())
        layer = self.layers[layer_idx]
        empty = self.__dict__.setdefault("_empty", {})
        if layer_idx not in empty:
            empty[layer_idx] = copy.copy(layer.__dict__)
        layer.__dict__.clear()
        layer.__dict__.update(copy.copy(empty[layer_idx]))
        return layer.update(key_states, value_states, *args, **kwargs)


class _ExtendingCache(DynamicCache):
    """The completion pass's cache: the recorded prompt keys and values, each repeated to the samples
    of its group (``counts``), in front of the completion's; read only, so a recomputed forward
    reads the same."""

    def __init__(self, recorded: _RecordingCache, counts: torch.Tensor) -> None:
        self.__dict__.update({k: v for k, v in recorded.__dict__.items() if k != "_empty"})
        self.counts = counts

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        kept = dict(layer.__dict__)
        try:
            layer.keys = layer.keys.repeat_interleave(self.counts, dim=0)
            layer.values = layer.values.repeat_interleave(self.counts, dim=0)
            return layer.update(key_states, value_states, *args, **kwargs)
        finally:
            layer.__dict__.clear()
            layer.__dict__.update(kept)


def _shared_prefix_hidden(decoder: torch.nn.Module, config, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states [N, S, H] at columns ``prompt_length − 1 + k`` (k = 0..S−1) of each sample
    (the states predicting its completion token k), with each group's prompt run once: one pass over
    the G distinct prompts fills a cache, a second runs every sample's completion on it (the prompt's
    keys and values repeated to its samples, so their gradients flow back into the one prompt pass).
    Rows of one group must be contiguous, as ``collate`` lays them out. Also the columns [N, S].
    ``batch.routing`` is replayed: in the prompt pass each group's first sample's at the prompt's
    columns, in the completion pass each sample's at the columns it reads (``p_len + k``)."""
    ids, p_lens, routing = batch.input_ids, batch.prompt_lengths, batch.routing
    length = ids.shape[1]
    device = ids.device
    _, counts = torch.unique_consecutive(batch.group_index, return_counts=True)
    first = counts.cumsum(0) - counts
    g_lens = p_lens[first]
    width = int(g_lens.max())
    in_prompt = torch.arange(width, device=device) < g_lens[:, None]
    prompt_mask = in_prompt.long()
    prompt_ids = torch.where(in_prompt, ids[first, :width], ids.new_zeros(()))
    cache = _RecordingCache(config=config)
    name = _cache_argument(decoder)
    plan = None if routing is None else torch.where(in_prompt[:, :, None, None], routing[first, :width], -1)
    with replay(decoder, plan):
        out = decoder(input_ids=prompt_ids, attention_mask=prompt_mask, use_cache=True, **{name: cache})
    # The prompt's last position predicts the first completion token of every sample.
    hidden = out.last_hidden_state[torch.arange(len(first), device=device), g_lens - 1]
    hidden = hidden.repeat_interleave(counts, dim=0)[:, None]
    c_lens = batch.attention_mask.sum(1) - p_lens
    # The completion pass runs even when no sample has a second token (its column is then unused):
    # every rank of a sharded model makes the same passes, each one a collective.
    steps = max(int(c_lens.max()), 2)
    j = torch.arange(steps, device=device)
    read = p_lens[:, None] + j[:-1]  # the columns the completion pass reads
    completion = ids.gather(1, read.clamp(max=length - 1))
    mask = torch.cat([prompt_mask.repeat_interleave(counts, dim=0), (j[:-1] < c_lens[:, None]).long()], dim=1)
    if routing is not None:
        plan = routing.gather(1, read.clamp(max=length - 1)[:, :, None, None].expand(-1, -1, *routing.shape[2:]))
        plan = torch.where((read < length)[:, :, None, None], plan, -1)
    with replay(decoder, plan):
        rest = decoder(input_ids=completion, attention_mask=mask, position_ids=read,
                       use_cache=True, **{name: _ExtendingCache(cache, counts)}).last_hidden_state
    return torch.cat([hidden, rest], dim=1), p_lens[:, None] - 1 + j


def _cache_argument(decoder: torch.nn.Module) -> str:
    """The name a decoder's forward takes its cache by: ``cache`` in newer transformers, else ``past_key_values``."""
    return _cache_argument_of(type(decoder))


@functools.cache
def _cache_argument_of(kind: type) -> str:
    return "cache" if "cache" in inspect.signature(kind.forward).parameters else "past_key_values"


class PolicyModel(torch.nn.Module):
    """A causal LM whose forward gives per-token log-probs and entropies of a ``TrainBatch`` at its
    trained tokens (``completion_mask > 0``; zero elsewhere), both [N, L−1] float32 (no entropies
    with ``own_forward``).

    ``shared_prefix``: each group's prompt runs once (``_shared_prefix_hidden``). ``chunk_mib``: the
    LM head's chunk (``chunked_head_logprobs``). ``own_forward``: instead, the model's own forward
    over every full sequence with whole logits, for architectures whose logits the chunked head does
    not reproduce (``check_fast_paths``)."""

    def __init__(self, lm: torch.nn.Module, *, shared_prefix: bool = True, chunk_mib: float = 256,
                 own_forward: bool = False) -> None:
        super().__init__()
        self.lm = lm
        self.shared_prefix = shared_prefix
        self.chunk_mib = chunk_mib
        self.own_forward = own_forward

    def forward(self, batch: TrainBatch, temperature: float = 1.0, shared_prefix: bool | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``shared_prefix``: this call's choice where the model has the shared prefix (None: it does)."""
        trained = batch.completion_mask > 0
        if self.own_forward:  # no entropy: the model's logits are not kept for it
            from trainer.loss import sequence_logprobs

            with replay(self.lm, batch.routing):
                full = sequence_logprobs(self.lm, batch.input_ids, batch.attention_mask, temperature=temperature)
            return torch.where(trained, full.float(), 0.0), None
        logp = torch.zeros(trained.shape, dtype=torch.float32, device=trained.device)
        entropy = torch.zeros_like(logp)
        decoder = self.lm.base_model
        if self.shared_prefix and shared_prefix is not False:
            hidden, columns = _shared_prefix_hidden(decoder, self.lm.config, batch)
            take = trained.gather(1, columns.clamp(max=trained.shape[1] - 1)) & (columns < trained.shape[1])
            rows, k = take.nonzero(as_tuple=True)
            cols = columns[rows, k]
            states = hidden[rows, k]
        else:
            with replay(decoder, batch.routing):
                hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 use_cache=False).last_hidden_state
            rows, cols = trained.nonzero(as_tuple=True)
            states = hidden[rows, cols]
        text = self.lm.config.get_text_config()
        lp, ent = chunked_head_logprobs(states, self.lm.get_output_embeddings(), batch.input_ids[rows, cols + 1],
                                        temperature=temperature, softcap=getattr(text, "final_logit_softcapping", None),
                                        chunk_mib=self.chunk_mib)
        return logp.index_put((rows, cols), lp), entropy.index_put((rows, cols), ent)


def checkpoint_layers(model: torch.nn.Module) -> int:
    """Activation checkpointing of every decoder layer (``GradientCheckpointingLayer``) of ``model``:
    its activations are recomputed in the backward pass. Unlike transformers' own switch it keeps
    the layers' cache, which the shared-prefix caches make safe to replay, and the routing a layer's
    forward replayed, which its recomputation replays again. Returns the layers wrapped."""
    wrapped = 0
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer) and not getattr(layer, "_rlbus_checkpointed", False):
            layer.forward = functools.partial(_checkpointed, layer.forward, routers_in(layer))
            layer._rlbus_checkpointed = True
            wrapped += 1
    return wrapped


def _checkpointed(forward, routers, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if routers:  # the recomputation routes as this forward does
        kwargs["context_fn"] = functools.partial(checkpoint_contexts, routers)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def check_fast_paths(lm: torch.nn.Module, vocab_size: int, pad_id: int, *, shared_prefix: bool = True,
                     chunk_mib: float = 256) -> PolicyModel:
    """``lm`` as a ``PolicyModel`` with the fast paths that give this architecture its own forward's
    log-probs on two synthetic groups: the chunked LM head (else the model's own forward, whole
    logits: an architecture that transforms its logits in a way the head does not know), then the
    shared prefix (else one forward per sample). Each one left out is said in a warning."""
    from trainer.loss import sequence_logprobs

    batch = _synthetic_batch(vocab_size, pad_id).to(next(lm.parameters()).device)
    mask = batch.completion_mask > 0
    kind = type(lm).__name__
    with torch.no_grad():
        expected = sequence_logprobs(lm, batch.input_ids, batch.attention_mask)[mask]

    def gap(policy: PolicyModel) -> float:
        try:
            with torch.no_grad():
                return float((policy(batch)[0][mask] - expected).abs().max())
        except Exception as exc:  # any failure of a fast path on this architecture means: do not use it
            logger.warning("%s: %s", kind, exc)
            return float("inf")

    if (g := gap(PolicyModel(lm, shared_prefix=False, chunk_mib=chunk_mib))) > 1e-3:
        logger.warning("%s: log-probs through the chunked LM head differ from the model's own by %.2g: training with "
                       "its own forward, whose [tokens × vocab] logits are held whole (more memory)", kind, g)
        return PolicyModel(lm, shared_prefix=False, chunk_mib=chunk_mib, own_forward=True)
    if shared_prefix and (g := gap(PolicyModel(lm, shared_prefix=True, chunk_mib=chunk_mib))) > 1e-3:
        logger.warning("%s: shared-prefix log-probs differ from the plain forward by %.2g; training with the plain "
                       "forward", kind, g)
        shared_prefix = False
    return PolicyModel(lm, shared_prefix=shared_prefix, chunk_mib=chunk_mib)


def _synthetic_batch(vocab_size: int, pad_id: int) -> TrainBatch:
    """Two groups of random tokens: prompts of 5 and 2 tokens, completions of 3, 1, 4 and 2, 3 tokens."""
    import time

    import numpy as np

    from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader
    from trainer.batch import collate

    rng = np.random.default_rng(0)
    low = min(3, vocab_size - 1)
    groups = []
    for g, (prompt_len, lengths) in enumerate(((5, (3, 1, 4)), (2, (2, 3)))):
        completion = rng.integers(low, vocab_size, size=sum(lengths)).astype(np.int32)
        header = TrajectoryHeader(
            run="check", policy="check", group_id=f"g{g}", prompt_id=f"p{g}", task="check", worker_id="check",
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4), rewards=[0.0] * len(lengths),
            finish_reasons=["stop"] * len(lengths), min_version=0, max_version=0, vocab_size=vocab_size,
            created_at=time.time())
        groups.append(TrajectoryGroup(
            header=header, prompt_tokens=rng.integers(low, vocab_size, size=prompt_len).astype(np.int32),
            completion_tokens=completion, completion_offsets=np.cumsum([0, *lengths]).astype(np.int32),
            behaviour_logprobs=np.zeros(len(completion), np.float32), token_versions=np.zeros(len(completion), np.int32)))
    return collate(groups, pad_id=pad_id)
