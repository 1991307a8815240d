"""One optimizer step of the policy on a batch of trajectory groups (GRPO/DAPO + decoupled PPO)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from broker.schema import TrajectoryGroup
from trainer.batch import TrainBatch, advantages, collate, drop_zero_advantage
from trainer.config import TrainerConfig
from trainer.loss import m2po_mask, policy_loss, sequence_logprobs, shared_prefix_logprobs


@dataclass
class StepResult:
    loss: float
    reward_mean: float
    tokens: int
    samples: int
    grad_norm: float
    stats: dict[str, float]


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[TrajectoryGroup],
    config: TrainerConfig,
    *,
    pad_id: int,
    temperature: float,
) -> StepResult:
    """``minibatches_per_step`` updates, each over whole groups, each averaging its loss over its
    own tokens. Proximal log-probs are those of the weights before this step: with one update they
    are the training forward itself (detached), with several they take one extra forward first."""
    full = collate(groups, pad_id)
    reward_mean = float(full.rewards.mean())
    # Groups whose samples all got the same reward carry no signal: skip their forward/backward.
    batch, adv = drop_zero_advantage(full, advantages(full.rewards, full.group_index, config.advantage_scale))
    if batch.num_samples == 0:
        return StepResult(loss=0.0, reward_mean=reward_mean, tokens=int(full.completion_mask.sum()),
                          samples=0, grad_norm=0.0, stats={})
    temperature = temperature if temperature > 0 else 1.0
    model.train()
    minibatches = batch.minibatch_rows(config.minibatches_per_step)
    prox = None
    if len(minibatches) > 1:
        # Later minibatches run on updated weights: their π_prox needs a forward pass before any update.
        with torch.no_grad():
            prox = _logprobs(model, batch, config, temperature)
    total_tokens = float(batch.completion_mask.sum().clamp(min=1.0))
    stats: dict[str, float] = {}
    losses, norms = [], []
    masked_tokens = 0
    for mb_rows in minibatches:
        optimizer.zero_grad(set_to_none=True)
        mb = batch.select(mb_rows)
        logp = _logprobs(model, mb, config, temperature)
        # One update per step: this forward runs on the weights before the update, so it is π_prox.
        mb_prox = logp.detach() if prox is None else prox[mb_rows]
        mask = mb.completion_mask
        if config.m2po_threshold is not None:
            mask = m2po_mask(logp.detach() - mb.behaviour_logprobs, mask, config.m2po_threshold)
            masked_tokens += int(mb.completion_mask.sum() - mask.sum())
        loss, mb_stats = policy_loss(
            logp,
            mb_prox,
            adv[mb_rows],
            mask,
            clip_low=config.clip_low,
            clip_high=config.clip_high,
            behaviour_logprobs=mb.behaviour_logprobs,
            importance_cap=config.importance_cap,
            agg=config.loss_agg,
        )
        share = float(mb.completion_mask.sum()) / total_tokens
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)))
        optimizer.step()
        losses.append(float(loss.detach()))
        for key, value in mb_stats.items():
            stats[key] = stats.get(key, 0.0) + value * share
    optimizer.zero_grad(set_to_none=True)
    if config.m2po_threshold is not None:
        stats["m2po_masked_tokens"] = float(masked_tokens)
    return StepResult(
        loss=sum(losses) / len(losses),
        reward_mean=reward_mean,
        tokens=int(full.completion_mask.sum()),
        samples=batch.num_samples,
        grad_norm=max(norms),
        stats=stats,
    )


def _logprobs(model: torch.nn.Module, batch: TrainBatch, config: TrainerConfig, temperature: float) -> torch.Tensor:
    """Per-token log-probs of the batch, computed on the model's device (in ``autocast_dtype`` when
    set) and returned on the CPU, where the batch's bookkeeping lives (gradients flow back through)."""
    device = next(model.parameters()).device
    on_device = batch if device.type == "cpu" else batch.to(device)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=config.autocast_dtype == "bfloat16"):
        if config.shared_prefix:
            lp = shared_prefix_logprobs(model, on_device, temperature=temperature)
        else:
            lp = sequence_logprobs(model, on_device.input_ids, on_device.attention_mask, temperature=temperature)
    return lp.float().cpu()
