"""The value model of GAE-based training (VAPO): a transformer with a scalar head, decoupled and
length-adaptive GAE, the value loss and its explained variance.

Alignment follows ``trainer.batch``: per-token column ``j`` describes the target token
``input_ids[:, j + 1]``, and its value is that of the state predicting it, the prefix
``input_ids[:, :j + 1]``, read from the hidden state at position ``j``. Rewards are outcome
rewards: the whole reward sits on a completion's last token. The value model lives at the trainer
only; values are computed when a step trains, by the current value model, for stale samples too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainer.config import TrainerConfig, ValueConfig

logger = logging.getLogger(__name__)

HEAD_FILE = "value_head.safetensors"


class ValueModel(torch.nn.Module):
    """``base`` (a transformer without its LM head) and a linear head to one scalar per position."""

    def __init__(self, base: torch.nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.base = base
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Values [N, L-1] (float32), aligned with the per-token columns of a ``TrainBatch``."""
        hidden = self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(hidden[:, :-1].float()).squeeze(-1)


def load_value_model(path: Path, device: str = "auto") -> ValueModel:
    """The transformer of the checkpoint at ``path`` (a causal LM's checkpoint loads without its LM
    head) under a scalar head: the one saved there by ``save_value_model``, else a zero head."""
    from transformers import AutoModel

    base = AutoModel.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    model = ValueModel(base, base.config.get_text_config().hidden_size).float()
    head = Path(path) / HEAD_FILE
    if head.is_file():
        model.head.load_state_dict(load_file(str(head)))
        logger.info("value model from %s with its saved head", path)
    else:
        logger.info("value model from %s with a new (zero) head: pretrain it (trainer.value.pretrain_steps)", path)
    from trainer.model import resolve_device

    return model.to(resolve_device(device))


def save_value_model(model: ValueModel, path: Path) -> None:
    """A checkpoint directory ``load_value_model`` (and ``trainer.value.path``) takes back."""
    model.base.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.head.state_dict().items()}, str(Path(path) / HEAD_FILE))


@dataclass
class Critic:
    """The value model, its optimizer and settings, as the trainer's step uses them."""

    model: ValueModel
    optimizer: torch.optim.Optimizer
    config: ValueConfig

    @classmethod
    def build(cls, config: TrainerConfig, default_path: Path, device: str) -> Critic:
        value = config.value
        model = load_value_model(Path(value.path) if value.path else default_path, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=value.lr or 2 * config.lr, betas=config.betas,
                                      weight_decay=config.weight_decay)
        return cls(model, optimizer, value)

    @property
    def base_lr(self) -> float:
        return self.optimizer.defaults["lr"]


def outcome_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards [N, T]: each sample's reward on its last completion token, zero elsewhere."""
    live = mask > 0
    last = torch.where(live, torch.arange(mask.shape[1]), -1).max(dim=1).values
    out = torch.zeros_like(mask, dtype=torch.float32)
    rows = (last >= 0).nonzero().squeeze(-1)
    out[rows, last[rows]] = rewards[rows].float()
    return out


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float,
        lam: float | torch.Tensor) -> torch.Tensor:
    """Generalised advantage estimates [N, T] over the completion tokens (zero elsewhere).

    δ_t = r_t + γ·V_{t+1} − V_t and A_t = δ_t + γλ·A_{t+1}, with V and A zero past a completion's
    last token; tokens outside the mask (padding, a prompt, tokens the loss skips) are passed over.
    ``lam`` is one λ or one per sample [N]. The value targets are ``gae(λ=λ_critic) + values``.
    """
    n, steps = values.shape
    lam_t = torch.as_tensor(lam, dtype=torch.float32).expand(n)
    live = mask > 0
    advantages = torch.zeros(n, steps)
    carry = torch.zeros(n)
    next_value = torch.zeros(n)
    for t in range(steps - 1, -1, -1):
        on = live[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        here = delta + gamma * lam_t * carry
        advantages[:, t] = torch.where(on, here, 0.0)
        carry = torch.where(on, here, carry)
        next_value = torch.where(on, values[:, t], next_value)
    return advantages


def adaptive_lambda(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive λ_policy = 1 − 1/(α·l) per completion of ``l`` tokens, in [0, 1]."""
    return (1.0 - 1.0 / (alpha * lengths.float().clamp(min=1.0))).clamp(0.0, 1.0)


def value_loss(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
               old_values: torch.Tensor | None = None, clip: float | None = None,
               tokens: float | None = None) -> torch.Tensor:
    """½·(V − return)², averaged over the completion tokens (``tokens``: the update's count, when these
    rows are part of it); with ``clip``, PPO's clipped form (the larger of the plain and the clipped
    error, the clipped value within ``clip`` of ``old_values``)."""
    err = (values - returns) ** 2
    if clip is not None and old_values is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (clipped - returns) ** 2)
    return 0.5 * (err * mask).sum() / max(float(mask.sum()) if tokens is None else tokens, 1.0)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var(return − V) / Var(return) over the completion tokens (1: perfect, 0: no better than a
    constant, negative: worse); nan when the returns do not vary."""
    live = mask > 0
    target = returns[live]
    var = float(target.var(unbiased=False)) if target.numel() else 0.0
    if var == 0.0:
        return float("nan")
    return 1.0 - float((target - values[live]).var(unbiased=False)) / var


def whiten(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Advantages centred and scaled to unit variance over the completion tokens."""
    live = mask > 0
    picked = advantages[live]
    if picked.numel() < 2:
        return advantages
    out = (advantages - picked.mean()) / (picked.std() + 1e-8)
    return torch.where(live, out, 0.0)
