"""Configuration of the learner: the checkpoint it starts from, its warm-up and the optimisation loop."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class WarmupConfig(BaseModel):
    """Short supervised warm-up that gives RL a non-zero reward to start from."""

    model_config = ConfigDict(extra="forbid")

    target_accuracy: float = Field(
        default=0.25,
        ge=0.0,
        le=1.0,
        description="Stop as soon as greedy accuracy on train prompts reaches this fraction.",
    )
    max_steps: int = Field(default=3000, ge=0, description="Hard cap on warm-up optimizer steps.")
    batch_size: int = Field(default=64, ge=1, description="Prompt/answer pairs per warm-up step.")
    lr: float = Field(default=1e-3, gt=0.0, description="AdamW learning rate of the warm-up.")
    eval_every_steps: int = Field(
        default=10, ge=1, description="Greedy accuracy is measured every this many steps."
    )
    eval_prompts: int = Field(
        default=256, ge=1, description="Train prompts used to measure warm-up accuracy."
    )


class ModelConfig(BaseModel):
    """The checkpoint the policy starts from."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        default=None,
        description="Hugging Face causal-LM checkpoint directory (config.json, weights, tokenizer files, chat "
        "template), loaded with from_pretrained: a local path, or an s3://bucket/prefix holding one (fetched "
        "by `rlbus prepare`). None: `rlbus prepare` builds the addition example's model (see [example]).",
    )


class TrainerConfig(BaseModel):
    """The RL optimisation loop of one policy."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(default=2e-4, gt=0.0, description="Peak AdamW learning rate.")
    lr_schedule: Literal["constant", "cosine"] = Field(
        default="cosine", description="Constant lr, or cosine decay from lr to min_lr_ratio * lr at max_steps."
    )
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0, description="Final lr as a fraction of lr.")
    betas: tuple[float, float] = Field(default=(0.9, 0.99), description="AdamW betas.")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW decoupled weight decay.")
    grad_clip: float = Field(default=1.0, gt=0.0, description="Max global gradient L2 norm.")
    groups_per_step: int = Field(
        default=32, ge=1, description="Trajectory groups (prompts) per optimizer step (B)."
    )
    minibatches_per_step: int = Field(
        default=1, ge=1, description="Optimizer updates per step; groups are split evenly."
    )
    clip_low: float = Field(default=0.2, ge=0.0, lt=1.0, description="DAPO lower clip epsilon.")
    clip_high: float = Field(default=0.28, ge=0.0, description="DAPO upper clip epsilon.")
    importance_cap: float | None = Field(
        default=5.0,
        gt=0.0,
        description="Cap on the decoupled-PPO weight pi_prox/pi_behav; None disables the cap.",
    )
    advantage_scale: Literal["std", "none"] = Field(
        default="std", description="Divide group-centred rewards by the group std ('std') or not."
    )
    loss_agg: Literal["token", "sequence"] = Field(
        default="token", description="Average the loss over all tokens or per sequence first."
    )
    shared_prefix: bool = Field(
        default=True,
        description="Run each group's prompt through the model once and its samples' completions on "
        "a copy of that KV cache (same log-probs and gradients as one forward per sample, fewer "
        "tokens). False: one padded forward over every full sequence.",
    )
    m2po_threshold: float | None = Field(
        default=None,
        gt=0.0,
        description="M2PO-style masking: before each update, mask the tokens with the largest "
        "(log pi_theta - log pi_behav)^2 until the mean over the rest is at most this; None = off.",
    )
    checkpoint_every: int = Field(default=50, ge=1, description="Optimizer steps between checkpoints.")
    checkpoints_kept: int = Field(default=2, ge=1, description="Newest checkpoints kept on disk.")
    max_steps: int = Field(default=900, ge=1, description="Optimizer steps before the run ends.")
    repair_anchor_after_s: float | None = Field(
        default=60, gt=0,
        description="Once groups have flowed, this long without a fresh one makes the trainer republish its weights "
        "as a full anchor under the next version: workers that cannot build the newest version (a damaged or "
        "missing chunk on its delta chain) move to it, and the run goes on. Once per such spell. None: never.",
    )
    idle_timeout_s: float = Field(
        default=300, gt=0, description="The trainer gives up when no trajectory arrives for this long, seconds."
    )
    seed: int = Field(default=0, description="Seed of the trainer's torch generator.")
    device: str = Field(
        default="auto", description="Torch device of the learner: 'auto' (cuda when present, else cpu), 'cpu', 'cuda:0'."
    )
    autocast_dtype: Literal["none", "bfloat16"] = Field(
        default="none",
        description="Mixed precision of the forward passes (master weights stay float32); bfloat16 on GPUs that have it.",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute activations in the backward pass (less memory, more compute); turns the "
        "shared-prefix forward off, which needs the KV cache.",
    )
    max_stage_drops_per_step: int = Field(
        default=10,
        ge=1,
        description="When the data stages drop more than this many batches' worth of groups (× groups_per_step) "
        "while one step fills, the step goes ahead with the dropped groups (they carry no signal, e.g. a model "
        "that never gets a reward) instead of waiting forever; the trainer warns.",
    )

    def lr_multiplier(self, step: int) -> float:
        """Factor on ``lr`` for optimizer step ``step`` (0-based); fits ``torch.optim.lr_scheduler.LambdaLR``."""
        if self.lr_schedule == "constant":
            return 1.0
        progress = min(max(step, 0) / self.max_steps, 1.0)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
