"""One optimizer step of the policy on a batch of trajectory groups: GRPO, DAPO, Dr. GRPO or VAPO
(a value model's GAE advantages), with decoupled PPO for stale samples.

Each optimizer update runs as micro-batches of whole samples up to ``trainer.micro_batch_tokens``
(``trainer.microbatch``), dealt to the ranks, whose gradients accumulate: every micro-batch's loss
is divided by the whole update's totals (``LossScale``), so the update is the whole batch's whatever
the budget and the number of ranks."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from broker.schema import TrajectoryGroup
from trainer.batch import TrainBatch, advantages, collate, drop_zero_advantage, step_advantages
from trainer.config import TrainerConfig
from trainer.logprobs import PolicyModel
from trainer.loss import LossScale, kl_estimate, m2po_mask, policy_loss, positive_lm_loss
from trainer.microbatch import default_micro_batch_tokens, plan, tokens, trimmed, without_training
from trainer.ranks import OneRank, Ranks
from trainer.value import Critic, adaptive_lambda, explained_variance, gae, outcome_rewards, value_loss, whiten


@dataclass
class StepResult:
    loss: float
    reward_mean: float
    tokens: int
    samples: int
    grad_norm: float
    stats: dict[str, float]


def as_policy(model: torch.nn.Module, config: TrainerConfig) -> PolicyModel:
    """``model`` as the step runs it: a ``PolicyModel`` (a bare causal LM is wrapped per ``config``)."""
    if isinstance(model, PolicyModel):
        return model
    return PolicyModel(model, shared_prefix=config.shared_prefix, chunk_mib=config.logits_chunk_mib)


def autocast_dtype(config: TrainerConfig, device: torch.device) -> torch.dtype | None:
    """The forward passes' autocast dtype: ``autocast_dtype``, where "auto" is bfloat16 on a GPU that
    has it and none elsewhere."""
    if config.autocast_dtype == "bfloat16":
        return torch.bfloat16
    if config.autocast_dtype == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


class _Passes:
    """How this step runs its forward passes: device, autocast, token budget, ranks, and whether with
    the shared prefix: where the policy has it and it runs fewer tokens over the step's batch (a group
    of one sample, or prompts of a token or two, gain nothing from a second pass)."""

    def __init__(self, policy: PolicyModel, config: TrainerConfig, ranks: Ranks, batch: TrainBatch) -> None:
        self.device = next(policy.parameters()).device
        self.dtype = autocast_dtype(config, self.device)
        self.budget = config.micro_batch_tokens or default_micro_batch_tokens(
            policy.lm, self.device, bf16=self.dtype is not None, checkpointing=config.gradient_checkpointing,
            world=ranks.world)
        rows = list(range(batch.num_samples))
        self.shared_prefix = policy.shared_prefix and not policy.own_forward and (
            tokens(batch, rows, shared_prefix=True) < tokens(batch, rows, shared_prefix=False))
        self.ranks = ranks
        self.balance_experts = config.balance_experts
        self.routing_replay = config.routing_replay
        self._planned: tuple[TrainBatch, list] | None = None  # the last batch planned, and its plan

    def logprobs(self, policy: PolicyModel, mb: TrainBatch, temperature: float):
        return policy(mb, temperature, shared_prefix=self.shared_prefix)

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def micro_batches(self, batch: TrainBatch, *extra: torch.Tensor):
        """This rank's micro-batches of ``batch``: (rows, the rows' batch trimmed and on the device,
        the rows of each ``extra`` per-sample [N] or per-token [N, L−1] tensor cut alike and on the
        device, live)."""
        if self._planned is None or self._planned[0] is not batch:  # balancing experts costs: once a batch
            self._planned = (batch, plan(batch, self.budget, shared_prefix=self.shared_prefix, world=self.ranks.world,
                                         rank=self.ranks.rank, balance_experts=self.balance_experts))
        for mb in self._planned[1]:
            part, *cut = trimmed(batch.select(mb.rows), *(t[mb.rows] for t in extra))
            if not self.routing_replay:  # the routing planned the micro-batches; the forward routes itself
                part = dataclasses.replace(part, routing=None)
            part = part if mb.live else without_training(part)
            yield mb.rows, part.to(self.device), [t.to(self.device) for t in cut], mb.live

    @torch.no_grad()
    def per_token(self, fn, batch: TrainBatch) -> torch.Tensor:
        """``fn(micro-batch)`` [n, w−1] of every row of ``batch``, gathered from all ranks: [N, L−1] on the CPU."""
        out = torch.zeros(batch.completion_mask.shape, dtype=torch.float32)
        for rows, mb, _, live in self.micro_batches(batch):
            with self.autocast():
                values = fn(mb)
            if live:
                out[rows, : values.shape[1]] = values.float().cpu()
        return self.ranks.all_reduce(out) if self.ranks.world > 1 else out


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
    ranks: Ranks | None = None,
) -> StepResult:
    """``ppo_epochs`` passes of ``minibatches_per_step`` updates, each over whole groups, each averaging
    its loss over its own tokens. Proximal log-probs are those of the weights before this step: with
    one update they are the training forward itself (detached), with several they take one extra
    forward first, so the ratio leaves 1 and clipping acts.

    ``critic``: advantages by GAE from its values (taken before its own updates), and a value update
    beside each policy update; ``reference``: the frozen policy of the KL term (``kl_coef``);
    ``policy_frozen``: train the value model only (value pretraining); ``ranks``: the trainer's ranks
    (every rank calls this with the same groups and takes its share of each update)."""
    ranks = ranks or OneRank()
    policy = as_policy(model, config)
    full = collate(groups, pad_id)
    if config.routing_replay and full.routing is None:
        raise ValueError(
            f"trainer.routing_replay is on, but the step's {len(groups)} groups carry no routing (e.g. "
            f"{groups[0].header.group_id} from worker {groups[0].header.worker_id}, engine {groups[0].header.engine}): "
            "replay needs a mixture-of-experts policy whose workers record it (engine.type = 'torch'; vLLM's CPU "
            "build records none). Set trainer.routing_replay = false to route in the trainer")
    passes = _Passes(policy, config, ranks, full)
    reward_mean = float(full.rewards.mean())
    stats: dict[str, float] = {}
    returns = old_values = None
    if critic is not None:
        batch = full
        adv, returns, old_values, stats = _gae_targets(critic, batch, passes)
    else:
        # The step_credit stage's graph (each turn: the mean over its node) or step advantages (added).
        batch, adv = full, step_advantages(advantages(full.rewards, full.group_index, config.advantage_scale),
                                           full.step_node, full.step_bonus)
        if not (config.kl_coef or config.lm_loss_coef):
            # Groups whose samples all got the same reward carry no signal: skip their forward/backward.
            batch, adv = drop_zero_advantage(full, adv)
    if batch.num_samples == 0:
        return StepResult(loss=0.0, reward_mean=reward_mean, tokens=int(full.completion_mask.sum()),
                          samples=0, grad_norm=0.0, stats={})
    temperature = temperature if temperature > 0 else 1.0
    policy.train()
    updates = [rows for _ in range(config.ppo_epochs) for rows in batch.minibatch_rows(config.minibatches_per_step)]
    prox = ref = None
    if not policy_frozen:
        if len(updates) > 1:
            # Later updates run on updated weights: their π_prox needs a forward pass before any update.
            prox = passes.per_token(lambda mb: passes.logprobs(policy, mb, temperature)[0], batch)
        if reference is not None and config.kl_coef:
            reference = as_policy(reference, config)
            ref = passes.per_token(lambda mb: passes.logprobs(reference, mb, temperature)[0], batch)
    total_tokens = float(batch.completion_mask.sum().clamp(min=1.0)) * config.ppo_epochs
    losses, norms = [], []
    masked_tokens = 0
    for k, rows in enumerate(updates):
        share = float(batch.completion_mask[rows].sum()) / total_tokens
        mb_stats: dict[str, float] = {}
        if not policy_frozen:
            update = _Update(batch.select(rows), adv[rows], None if prox is None else prox[rows],
                             None if ref is None else ref[rows])
            if config.m2po_threshold is not None:
                masked_tokens += update.m2po(policy, passes, config, temperature, prox_current=k == 0 and prox is not None)
            loss, norm, mb_stats = _policy_update(policy, optimizer, update, config, temperature, passes)
            losses.append(loss)
            norms.append(norm)
        if critic is not None:
            mb_stats.update(_value_update(critic, batch.select(rows), returns[rows], old_values[rows], passes))
        for key, value in mb_stats.items():
            stats[key] = max(stats.get(key, value), value) if key.endswith("_max") else stats.get(key, 0.0) + value * share
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


@dataclass
class _Update:
    """One optimizer update's rows: their batch, advantages, and π_prox / π_ref log-probs when
    computed before the step (CPU, full width)."""

    batch: TrainBatch
    adv: torch.Tensor
    prox: torch.Tensor | None
    ref: torch.Tensor | None

    def m2po(self, policy, passes: _Passes, config: TrainerConfig, temperature: float, *, prox_current: bool) -> int:
        """Replace the update's mask by M2PO's, taken over the whole update from the current policy's
        log-probs (π_prox when no update has run yet); returns the tokens it masked."""
        current = self.prox if prox_current else passes.per_token(
            lambda mb: passes.logprobs(policy, mb, temperature)[0], self.batch)
        mask = self.batch.completion_mask
        kept = m2po_mask(current - self.batch.behaviour_logprobs, mask, config.m2po_threshold)
        self.batch = dataclasses.replace(self.batch, completion_mask=kept)
        return int(mask.sum() - kept.sum())


def _policy_update(policy: PolicyModel, optimizer, update: _Update, config: TrainerConfig, temperature: float,
                   passes: _Passes) -> tuple[float, float, dict]:
    """One optimizer update of the policy over the update's micro-batches: (loss, grad norm, stats)."""
    optimizer.zero_grad(set_to_none=True)
    batch = update.batch
    positive = batch.rewards > config.lm_loss_reward_above
    scale = LossScale.of(batch.completion_mask, positive if config.lm_loss_coef else None)
    sums = _Sums()
    extra = [t for t in (update.adv, update.prox, update.ref) if t is not None]
    for _, mb, cut, live in passes.micro_batches(batch, *extra):
        mb_adv = cut.pop(0)
        mb_prox = cut.pop(0) if update.prox is not None else None
        mb_ref = cut.pop(0) if update.ref is not None else None
        with passes.autocast():
            logp, entropy = passes.logprobs(policy, mb, temperature)
        mask = mb.completion_mask
        loss, stats = policy_loss(
            logp, logp.detach() if mb_prox is None else mb_prox, mb_adv, mask,
            clip_low=config.clip_low, clip_high=config.clip_high,
            behaviour_logprobs=mb.behaviour_logprobs, importance_cap=config.importance_cap,
            agg=config.loss_agg, norm_tokens=config.loss_norm_tokens,
            kl=None if mb_ref is None else kl_estimate(logp, mb_ref, config.kl_estimator), kl_coef=config.kl_coef,
            scale=scale,
        )
        parts = {"loss": float(loss.detach())}  # each the micro-batch's share of the update's figure
        if config.lm_loss_coef:
            lm = positive_lm_loss(logp, mask, mb.rewards > config.lm_loss_reward_above, total=scale.positive_tokens)
            loss = loss + config.lm_loss_coef * lm
            parts.update(loss=float(loss.detach()), lm_loss=float(lm.detach()))
        if entropy is not None:
            stats["entropy"] = float((entropy * mask).sum() / mask.sum().clamp(min=1.0))
        # Ranks' gradients are averaged by the sharded model; the loss is already the update's mean.
        (loss * (passes.ranks.world if live else 0.0)).backward()
        sums.add(stats, float(mask.sum()) if live else 0.0, parts if live else dict.fromkeys(parts, 0.0))
    norm = float(_full(torch.nn.utils.clip_grad_norm_(policy.parameters(), config.grad_clip)))
    optimizer.step()
    stats = sums.result(passes.ranks, scale.tokens)
    return stats.pop("loss"), norm, stats


class _Sums:
    """A step's figures over micro-batches and ranks: stats as means over tokens (``*_max`` as maxima,
    ``tokens`` as a count); ``parts`` (the loss, the LM loss), each micro-batch's share of the
    update's figure, as sums. A micro-batch without trained tokens (a rank's stand-in) adds its keys,
    so every rank reduces the same ones, but not its maxima: those speak of no token."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.parts: dict[str, float] = {}
        self.empty: dict[str, float] = {}  # the maxima as a micro-batch without tokens gives them

    def add(self, stats: dict[str, float], tokens: float, parts: dict[str, float]) -> None:
        for key, value in parts.items():
            self.parts[key] = self.parts.get(key, 0.0) + value
        for key, value in stats.items():
            if key.endswith("_max"):
                if tokens:
                    self.sums[key] = max(self.sums.get(key, value), value)
                else:
                    self.sums.setdefault(key, float("-inf"))
                    self.empty[key] = value
            else:
                self.sums[key] = self.sums.get(key, 0.0) + (value if key == "tokens" else value * tokens)

    def result(self, ranks: Ranks, tokens: float) -> dict[str, float]:
        parts = sorted(self.parts)
        summed = sorted(k for k in self.sums if not k.endswith("_max"))
        maxed = sorted(k for k in self.sums if k.endswith("_max"))
        total = ranks.all_reduce(torch.tensor([*(self.parts[k] for k in parts), *(self.sums[k] for k in summed)],
                                              dtype=torch.float64)).tolist()
        top = ranks.all_reduce(torch.tensor([self.sums[k] for k in maxed], dtype=torch.float64), "max").tolist()
        out = dict(zip(parts, total[: len(parts)]))
        out.update({k: v if k == "tokens" else v / max(tokens, 1.0) for k, v in zip(summed, total[len(parts):])})
        out.update((k, v if v > float("-inf") else self.empty[k]) for k, v in zip(maxed, top))
        return out


def _full(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm as a plain tensor (a sharded model's is a DTensor)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _gae_targets(critic: Critic, batch: TrainBatch, passes: _Passes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    """Token advantages (λ_policy, whitened if set), value targets (λ_critic), the values they came
    from, and stats: all from the current value model, whatever version generated the samples."""
    cfg, mask = critic.config, batch.completion_mask
    critic.model.eval()
    values = passes.per_token(lambda mb: critic.model(mb.input_ids, mb.attention_mask), batch) * mask
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


def _value_update(critic: Critic, batch: TrainBatch, returns: torch.Tensor, old_values: torch.Tensor,
                  passes: _Passes) -> dict[str, float]:
    """One optimizer update of the value model toward ``returns`` over the update's micro-batches."""
    critic.model.train()
    critic.optimizer.zero_grad(set_to_none=True)
    tokens = float(batch.completion_mask.sum())
    sums = _Sums()
    for _, mb, (mb_returns, mb_old), live in passes.micro_batches(batch, returns, old_values):
        with passes.autocast():
            values = critic.model(mb.input_ids, mb.attention_mask).float()
        loss = value_loss(values, mb_returns, mb.completion_mask, old_values=mb_old, clip=critic.config.clip,
                          tokens=tokens)
        (loss * (passes.ranks.world if live else 0.0)).backward()
        sums.add({}, 0.0, {"value_loss": float(loss.detach()) if live else 0.0})
    norm = float(_full(torch.nn.utils.clip_grad_norm_(critic.model.parameters(), critic.config.grad_clip)))
    critic.optimizer.step()
    critic.optimizer.zero_grad(set_to_none=True)
    return {**sums.result(passes.ranks, tokens), "value_grad_norm": norm}
