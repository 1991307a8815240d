"""Policy-gradient loss: DAPO's decoupled clip with token-level averaging, and decoupled PPO.

Notation, per completion token ``t`` with advantage ``A``:

* ``logprobs``            log pi_theta(t), the policy being optimised (carries the gradient);
* ``old_logprobs``        log pi_prox(t), the proximal policy: the trainer's weights before this
                          step's updates (recomputed by the trainer, no gradient);
* ``behaviour_logprobs``  log pi_behav(t), what the rollout engine sampled with (possibly older).

    r      = pi_theta / pi_prox
    w      = pi_prox / pi_behav            (only when behaviour log-probs are given; detached,
                                            optionally capped at ``importance_cap``)
    L_t    = -w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)

``agg="token"`` averages L_t over every unmasked token of the batch (DAPO); ``agg="sequence"``
averages within each sequence first, then over sequences (original GRPO); ``agg="constant"`` sums
each sequence's tokens and divides by a constant ``norm_tokens`` (Dr. GRPO), then averages over
sequences. With a reference policy, ``kl_coef · KL_t`` (``kl_estimate``) joins each token's loss
before the average, as GRPO adds it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LossScale:
    """The totals an update's loss is divided by. An update spread over micro-batches (and ranks)
    passes the whole update's, so the accumulated gradient is the whole batch's."""

    tokens: float  # trained tokens (mask > 0)
    sequences: float  # samples with at least one trained token
    positive_tokens: float = 0.0  # trained tokens of the samples the positive-example LM loss takes

    @classmethod
    def of(cls, mask: torch.Tensor, positive: torch.Tensor | None = None) -> LossScale:
        live = (mask > 0).float()
        pos = 0.0 if positive is None else float((live * positive.float()[:, None]).sum())
        return cls(tokens=float(live.sum()), sequences=float((live.sum(1) > 0).sum()), positive_tokens=pos)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    behaviour_logprobs: torch.Tensor | None = None,
    importance_cap: float | None = None,
    agg: Literal["token", "sequence", "constant"] = "token",
    norm_tokens: int | None = None,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    scale: LossScale | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss (scalar, to minimise) and float stats; tensors are [B, T], ``advantages`` [B] or [B, T].
    ``scale``: the update's totals when these rows are part of it (default: these rows' own); the
    stats are means over these rows' tokens."""
    mask = mask.to(logprobs.dtype)
    live = mask > 0
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    advantages = advantages.to(logprobs.dtype).expand_as(logprobs)
    log_ratio = torch.where(live, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    ratio = log_ratio.exp()
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    weight = torch.ones_like(logprobs)
    if behaviour_logprobs is not None:
        log_w = torch.where(live, old_logprobs - behaviour_logprobs, torch.zeros_like(logprobs))
        weight = log_w.detach().exp()
        if importance_cap is not None:
            weight = weight.clamp(max=importance_cap)
        per_token = per_token * weight
    if kl is not None and kl_coef:
        per_token = per_token + kl_coef * kl
    per_token = per_token * mask
    n_tokens = mask.sum().clamp(min=1.0)
    lengths = mask.sum(dim=1)
    has_tokens = lengths > 0
    scale = scale or LossScale.of(mask)
    if agg == "token":
        loss = per_token.sum() / max(scale.tokens, 1.0)
    elif agg == "sequence":
        per_seq = per_token.sum(dim=1)[has_tokens] / lengths[has_tokens]
        loss = per_seq.sum() / max(scale.sequences, 1.0) if per_seq.numel() else per_token.sum()
    elif agg == "constant":
        if norm_tokens is None:
            raise ValueError("agg='constant' needs norm_tokens (trainer.loss_norm_tokens)")
        loss = per_token.sum() / (norm_tokens * max(scale.sequences, 1.0))
    else:
        raise ValueError(f"agg must be 'token', 'sequence' or 'constant', got {agg!r}")

    with torch.no_grad():
        clipped_low = (ratio < 1.0 - clip_low) & (advantages < 0)
        clipped_high = (ratio > 1.0 + clip_high) & (advantages > 0)
        stats = {
            "clip_fraction": float(((clipped_low | clipped_high) & live).sum() / n_tokens),
            "clip_low_fraction": float((clipped_low & live).sum() / n_tokens),
            "clip_high_fraction": float((clipped_high & live).sum() / n_tokens),
            "approx_kl": float((((ratio - 1.0) - log_ratio) * mask).sum() / n_tokens),
            "ratio_mean": float((ratio * mask).sum() / n_tokens),
            "importance_weight_mean": float((weight * mask).sum() / n_tokens),
            "importance_weight_max": float(weight[live].max()) if bool(live.any()) else 1.0,
            "tokens": float(mask.sum()),
        }
        if kl is not None:
            stats["kl_ref"] = float((kl * mask).sum() / n_tokens)
    return loss, stats


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: Literal["k1", "k3"]) -> torch.Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from tokens sampled by π_θ (Schulman's k1 and k3).

    k1 = log π_θ − log π_ref (unbiased, can be negative); k3 = r − log r − 1 with r = π_ref/π_θ
    (unbiased, never negative, lower variance). Gradients flow through ``logprobs`` only."""
    log_r = ref_logprobs.detach() - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k3":
        return log_r.exp() - log_r - 1.0
    raise ValueError(f"kl estimator must be 'k1' or 'k3', got {estimator!r}")


def positive_lm_loss(logprobs: torch.Tensor, mask: torch.Tensor, positive: torch.Tensor,
                     total: float | None = None) -> torch.Tensor:
    """VAPO's positive-example LM loss: mean negative log-likelihood over the completion tokens of the
    samples marked ``positive`` [B] (zero, with a gradient path, when there are none); ``total``: the
    update's count of such tokens when these rows are part of it."""
    keep = mask * positive.to(mask.dtype)[:, None]
    return -(logprobs * keep).sum() / max(float(keep.sum()) if total is None else total, 1.0)


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs [B, L-1] of token ``t+1`` given tokens ``<= t`` under ``softmax(logits / T)``.

    Sequences must be right-padded (the positions of real tokens then start at 0). Use the
    sampling temperature as ``temperature`` so the result compares with behaviour log-probs.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logits = logits[:, :-1, :].float()
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def m2po_mask(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO-style token mask: drop the tokens with the largest second moment ``log_ratio**2``
    until the mean of ``log_ratio**2`` over the tokens kept is ≤ ``threshold``.

    ``log_ratio`` is log π_θ − log π_behav (detached); returns a new float mask. Removing the
    largest values first is optimal: it lowers the mean fastest for each token removed.
    """
    live = mask > 0
    m2 = (log_ratio.detach().float() ** 2)[live]
    if m2.numel() == 0 or float(m2.mean()) <= threshold:
        return mask.clone().float()
    values, order = m2.sort(descending=True)
    n = values.numel()
    # mean of the tokens kept after removing the k largest, for k = 0..n-1
    suffix_sum = values.flip(0).cumsum(0).flip(0)
    kept_mean = suffix_sum / torch.arange(n, 0, -1, dtype=values.dtype)
    ok = (kept_mean <= threshold).nonzero()
    k = int(ok[0]) if ok.numel() else n
    drop = torch.zeros(n, dtype=torch.bool)
    drop[order[:k]] = True
    out = mask.clone().float()
    flat_idx = live.nonzero(as_tuple=True)
    out[tuple(i[drop] for i in flat_idx)] = 0.0
    return out
