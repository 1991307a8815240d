"""One optimizer step of the policy on a batch of trajectory groups: GRPO, DAPO, Dr. GRPO or VAPO
(a value model's GAE advantages), with decoupled PPO for stale samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from broker.schema import TrajectoryGroup
from trainer.batch import TrainBatch, advantages, collate, drop_zero_advantage
from trainer.config import TrainerConfig
from trainer.loss import (
    kl_estimate,
    m2po_mask,
    policy_loss,
    positive_lm_loss,
    sequence_logprobs,
    shared_prefix_logprobs,
)
from trainer.value import Critic, adaptive_lambda, explained_variance, gae, outcome_rewards, value_loss, whiten


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
    critic: Critic | None = None,
    reference: torch.nn.Module | None = None,
    policy_frozen: bool = False,
) -> StepResult:
    """``ppo_epochs`` passes of ``minibatches_per_step`` updates, each over whole groups, each averaging
    its loss over its own tokens. Proximal log-probs are those of the weights before this step: with
    one update they are the training forward itself (detached), with several they take one extra
    forward first, so the ratio leaves 1 and clipping acts.

    ``critic``: advantages by GAE from its values (taken before its own updates), and a value update
    beside each policy update; ``reference``: the frozen policy of the KL term (``kl_coef``);
    ``policy_frozen``: train the value model only (value pretraining)."""
    full = collate(groups, pad_id)
    reward_mean = float(full.rewards.mean())
    stats: dict[str, float] = {}
    returns = old_values = None
    if critic is not None:
        batch = full
        adv, returns, old_values, stats = _gae_targets(critic, batch)
    else:
        batch, adv = full, advantages(full.rewards, full.group_index, config.advantage_scale)
        if not (config.kl_coef or config.lm_loss_coef):
            # Groups whose samples all got the same reward carry no signal: skip their forward/backward.
            batch, adv = drop_zero_advantage(full, adv)
    if batch.num_samples == 0:
        return StepResult(loss=0.0, reward_mean=reward_mean, tokens=int(full.completion_mask.sum()),
                          samples=0, grad_norm=0.0, stats={})
    temperature = temperature if temperature > 0 else 1.0
    model.train()
    updates = [rows for _ in range(config.ppo_epochs) for rows in batch.minibatch_rows(config.minibatches_per_step)]
    prox = ref = None
    if not policy_frozen:
        with torch.no_grad():
            if len(updates) > 1:
                # Later updates run on updated weights: their π_prox needs a forward pass before any update.
                prox = _logprobs(model, batch, config, temperature)
            if reference is not None and config.kl_coef:
                ref = _logprobs(reference, batch, config, temperature)
    total_tokens = float(batch.completion_mask.sum().clamp(min=1.0)) * config.ppo_epochs
    losses, norms = [], []
    masked_tokens = 0
    for rows in updates:
        mb = batch.select(rows)
        share = float(mb.completion_mask.sum()) / total_tokens
        mb_stats: dict[str, float] = {}
        if not policy_frozen:
            loss, norm, mb_stats, masked = _policy_update(
                model, optimizer, mb, adv[rows], config, temperature,
                prox=None if prox is None else prox[rows], ref=None if ref is None else ref[rows])
            losses.append(loss)
            norms.append(norm)
            masked_tokens += masked
        if critic is not None:
            mb_stats.update(_value_update(critic, mb, returns[rows], old_values[rows]))
        for key, value in mb_stats.items():
            stats[key] = stats.get(key, 0.0) + value * share
    optimizer.zero_grad(set_to_none=True)
    if config.m2po_threshold is not None:
        stats["m2po_masked_tokens"] = float(masked_tokens)
    if policy_frozen:
        stats["policy_frozen"] = 1.0
    return StepResult(
        loss=sum(losses) / len(losses) if losses else 0.0,
        reward_mean=reward_mean,
        tokens=int(full.completion_mask.sum()),
        samples=batch.num_samples,
        grad_norm=max(norms, default=0.0),
        stats=stats,
    )


def _policy_update(model, optimizer, mb: TrainBatch, adv: torch.Tensor, config: TrainerConfig, temperature: float,
                   *, prox: torch.Tensor | None, ref: torch.Tensor | None) -> tuple[float, float, dict, int]:
    """One optimizer update of the policy on minibatch ``mb``: (loss, grad norm, stats, tokens M2PO masked)."""
    optimizer.zero_grad(set_to_none=True)
    logp = _logprobs(model, mb, config, temperature)
    # One update per step: this forward runs on the weights before the update, so it is π_prox.
    mb_prox = logp.detach() if prox is None else prox
    mask = mb.completion_mask
    masked = 0
    if config.m2po_threshold is not None:
        mask = m2po_mask(logp.detach() - mb.behaviour_logprobs, mask, config.m2po_threshold)
        masked = int(mb.completion_mask.sum() - mask.sum())
    loss, stats = policy_loss(
        logp, mb_prox, adv, mask,
        clip_low=config.clip_low, clip_high=config.clip_high,
        behaviour_logprobs=mb.behaviour_logprobs, importance_cap=config.importance_cap,
        agg=config.loss_agg, norm_tokens=config.loss_norm_tokens,
        kl=None if ref is None else kl_estimate(logp, ref, config.kl_estimator), kl_coef=config.kl_coef,
    )
    if config.lm_loss_coef:
        lm = positive_lm_loss(logp, mask, mb.rewards > config.lm_loss_reward_above)
        loss = loss + config.lm_loss_coef * lm
        stats["lm_loss"] = float(lm.detach())
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip))
    optimizer.step()
    return float(loss.detach()), norm, stats, masked


def _gae_targets(critic: Critic, batch: TrainBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Token advantages (λ_policy, whitened if set), value targets (λ_critic), the values they came
    from, and stats: all from the current value model, whatever version generated the samples."""
    cfg, mask = critic.config, batch.completion_mask
    critic.model.eval()
    with torch.no_grad():
        values = critic.values(batch) * mask
    rewards = outcome_rewards(batch.rewards, mask)
    returns = (gae(rewards, values, mask, gamma=cfg.gamma, lam=cfg.lambda_critic) + values) * mask
    lam = cfg.lambda_policy if cfg.lambda_alpha is None else adaptive_lambda(mask.sum(1), cfg.lambda_alpha)
    adv = gae(rewards, values, mask, gamma=cfg.gamma, lam=lam)
    if cfg.whiten_advantages:
        adv = whiten(adv, mask)
    live = mask > 0
    stats = {"value_mean": float(values[live].mean()) if bool(live.any()) else 0.0,
             "lambda_policy_mean": float(torch.as_tensor(lam, dtype=torch.float32).mean())}
    ev = explained_variance(values, returns, mask)
    if ev == ev:  # nan when every return is the same: nothing to explain
        stats["explained_variance"] = ev
    return adv, returns, values, stats


def _value_update(critic: Critic, mb: TrainBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
    """One optimizer update of the value model toward ``returns`` on minibatch ``mb``."""
    critic.model.train()
    critic.optimizer.zero_grad(set_to_none=True)
    loss = value_loss(critic.values(mb), returns, mb.completion_mask, old_values=old_values, clip=critic.config.clip)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(critic.model.parameters(), critic.config.grad_clip))
    critic.optimizer.step()
    critic.optimizer.zero_grad(set_to_none=True)
    return {"value_loss": float(loss.detach()), "value_grad_norm": norm}


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
