"""Configuration of the learner: the checkpoint it starts from, its warm-up and the optimisation loop."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.algorithms import with_preset


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


class ValueConfig(BaseModel):
    """The value model (critic) of GAE-based training (VAPO), used when ``advantage_estimator = "gae"``;
    it lives at the trainer only."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        default=None,
        description="Checkpoint directory its transformer is loaded from (AutoModel.from_pretrained; a "
        "value_head.safetensors there gives the scalar head, else the head starts at zero); None: a copy of "
        "the policy's starting checkpoint.",
    )
    lr: float | None = Field(default=None, gt=0.0, description="Its AdamW learning rate; None: twice trainer.lr "
                             "(VAPO's 2e-6 against 1e-6). It follows trainer.lr_schedule.")
    pretrain_steps: int = Field(
        default=50, ge=0,
        description="The first this many optimizer steps train the value model only (the policy's weights stay, "
        "so workers keep sampling the starting policy); they count toward trainer.max_steps.",
    )
    gamma: float = Field(default=1.0, ge=0.0, le=1.0, description="Discount per token.")
    lambda_critic: float = Field(default=1.0, ge=0.0, le=1.0,
                                 description="GAE λ of the value targets (1.0: unbiased Monte-Carlo returns).")
    lambda_alpha: float | None = Field(
        default=0.05, gt=0.0,
        description="Length-adaptive GAE λ of the policy's advantages, λ = 1 − 1/(α·l) for a completion of l "
        "tokens, clamped to [0, 1] (completions of at most 1/α tokens get λ = 0); None: lambda_policy.",
    )
    lambda_policy: float = Field(default=0.95, ge=0.0, le=1.0,
                                 description="Fixed GAE λ of the advantages when lambda_alpha is None.")
    whiten_advantages: bool = Field(
        default=True, description="Centre and scale the advantages over the step's completion tokens (PPO's usual whitening)."
    )
    clip: float | None = Field(
        default=None, gt=0.0,
        description="PPO value clipping: the new value stays within this of the value before the step; None: off.",
    )
    grad_clip: float = Field(default=1.0, gt=0.0, description="Max global gradient L2 norm of the value model.")


class TrainerConfig(BaseModel):
    """The RL optimisation loop of one policy."""

    model_config = ConfigDict(extra="forbid")

    algorithm: Literal["grpo", "dapo", "dr_grpo", "vapo"] | None = Field(
        default=None,
        description="A preset of the fields below as the paper documents them (trainer/algorithms.py lists "
        "each); the fields given in the config override it. None: the fields' own defaults (DAPO's clipping "
        "and token-level loss).",
    )
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
        default=1, ge=1, description="Optimizer updates per epoch; groups are split evenly."
    )
    ppo_epochs: int = Field(
        default=1, ge=1,
        description="Passes over the step's groups. With more than one update per step (epochs × minibatches) "
        "the proximal policy π_prox is the weights before the first, so the PPO ratio leaves 1 and the "
        "clip range (clip_low, clip_high) acts; with one update the ratio is 1 and clipping never acts.",
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
    advantage_estimator: Literal["group", "gae"] = Field(
        default="group",
        description="'group': each sample's reward minus its group's mean (÷ its std with advantage_scale = "
        "'std'): GRPO, DAPO, Dr. GRPO. 'gae': generalised advantage estimates from a value model ([trainer.value]): "
        "VAPO. Values are computed at training time by the current value model, for stale samples too.",
    )
    loss_agg: Literal["token", "sequence", "constant"] = Field(
        default="token",
        description="Average the loss over all tokens ('token', DAPO), per sequence first ('sequence', GRPO), or "
        "sum each sequence's tokens and divide by loss_norm_tokens ('constant', Dr. GRPO).",
    )
    loss_norm_tokens: int | None = Field(
        default=None, ge=1,
        description="The constant of loss_agg = 'constant'; None: the policy's sampling.max_new_tokens.",
    )
    kl_coef: float = Field(default=0.0, ge=0.0, description="β of the KL penalty to a frozen reference; 0: none "
                           "(and no reference is loaded).")
    kl_estimator: Literal["k1", "k3"] = Field(
        default="k3", description="Per-token KL estimator: k1 = log π − log π_ref, k3 = r − log r − 1 with "
        "r = π_ref/π (unbiased, non-negative; GRPO's)."
    )
    kl_reference: str | None = Field(
        default=None, description="Checkpoint directory of the reference; None: the checkpoint the run starts "
        "from (its version 0)."
    )
    lm_loss_coef: float = Field(
        default=0.0, ge=0.0,
        description="μ of VAPO's positive-example LM loss: the negative log-likelihood of the completion tokens of "
        "samples whose reward is above lm_loss_reward_above, added to the loss; 0: off.",
    )
    lm_loss_reward_above: float = Field(default=0.0, description="A sample is positive when its reward is above this.")
    value: ValueConfig = Field(
        default_factory=ValueConfig,
        description="The value model's settings; it is loaded and trained only with advantage_estimator = 'gae'.",
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
    autocast_dtype: Literal["auto", "none", "bfloat16"] = Field(
        default="auto",
        description="Mixed precision of the forward passes (master weights, gradients and the optimizer stay float32): "
        "'auto' is bfloat16 on a GPU that has it and none elsewhere.",
    )
    micro_batch_tokens: int | None = Field(
        default=None, ge=1,
        description="Token budget of one forward/backward pass: every optimizer update is split into micro-batches of "
        "whole samples up to this many tokens (padding included; with the shared prefix a group's prompt counts "
        "once), whose gradients accumulate into the same update the whole batch would give. None: chosen for the "
        "device (8,192 on a CPU; on a GPU from its memory, the model's size and an estimate of its activations).",
    )
    routing_replay: bool = Field(
        default=False,
        description="Rollout Routing Replay (R3) for a mixture-of-experts policy: every forward of the step routes each "
        "token to the experts the rollout engine selected for it (recorded in the trajectory records), with the "
        "router's probabilities still computed live, so the ratio is taken under the routing that generated the "
        "tokens and the router still learns. Records without routing (a dense policy, or an engine that records "
        "none, such as vLLM's CPU build) are refused. False: the trainer routes every token itself.",
    )
    balance_experts: bool = Field(
        default=True,
        description="For a mixture-of-experts policy whose records carry their routing: pack and deal the "
        "micro-batches so that each pass loads the experts evenly (a pass waits on its busiest expert), within "
        "micro_batch_tokens and in no more passes than packing samples in order; a plan that models no faster "
        "keeps that order. No effect without routing.",
    )
    logits_chunk_mib: float = Field(
        default=256, ge=0,
        description="Log-probs are computed from the last hidden states through the LM head this many MiB of float32 "
        "logits at a time, recomputed in the backward pass, so [tokens × vocab] logits are never held whole (a few "
        "chunk-sized buffers at a time). 0: all at once, kept for the backward.",
    )
    gradient_checkpointing: bool = Field(
        default=False,
        description="Recompute each decoder layer's activations in the backward pass (less memory; each layer's "
        "forward runs again in the backward); composes with the shared-prefix forward and with micro-batches.",
    )
    max_stage_drops_per_step: int = Field(
        default=10,
        ge=1,
        description="When the data stages drop more than this many batches' worth of groups (× groups_per_step) "
        "while one step fills, the step goes ahead with the dropped groups (they carry no signal, e.g. a model "
        "that never gets a reward) instead of waiting forever; the trainer warns.",
    )

    @model_validator(mode="wrap")
    @classmethod
    def _preset(cls, data, handler):
        """Lay ``algorithm``'s preset under the fields given; only the fields given count as set, so a
        policy's trainer that names another algorithm gets that preset, not this one's values."""
        if not isinstance(data, dict) or not data.get("algorithm"):
            return handler(data)
        config = handler(with_preset(data))
        object.__setattr__(config, "__pydantic_fields_set__", {k for k in data if k in cls.model_fields})
        return config

    @property
    def updates_per_step(self) -> int:
        return self.ppo_epochs * self.minibatches_per_step

    def lr_multiplier(self, step: int) -> float:
        """Factor on ``lr`` for optimizer step ``step`` (0-based); fits ``torch.optim.lr_scheduler.LambdaLR``."""
        if self.lr_schedule == "constant":
            return 1.0
        progress = min(max(step, 0) / self.max_steps, 1.0)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
