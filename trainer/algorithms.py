"""``trainer.algorithm`` presets: the settings each paper documents, laid under the fields a config gives.

A preset fills only the fields the config leaves out; every field stays overridable, and a
policy's own ``[policies.trainer]`` may pick another preset. What a preset does not cover is
data selection, configured as stages: DAPO's dynamic sampling is ``[[trainer_stages]] type =
"dynamic_sampling"`` (on in ``configs/default.toml``, whichever algorithm runs), and the learning
rates, which depend on the model (the papers' 1e-6 is for 7–32B models).
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    # DeepSeekMath (Shao et al. 2024): group-normalised advantages, ε = 0.2 both ways, per-sequence
    # loss average, KL to the reference by the k3 estimator with β = 0.04.
    "grpo": {"advantage_scale": "std", "loss_agg": "sequence", "clip_low": 0.2, "clip_high": 0.2,
             "kl_coef": 0.04, "kl_estimator": "k3", "lm_loss_coef": 0.0, "advantage_estimator": "group"},
    # DAPO (Yu et al. 2025): clip-higher (0.2 / 0.28), token-level loss, no KL term.
    "dapo": {"advantage_scale": "std", "loss_agg": "token", "clip_low": 0.2, "clip_high": 0.28,
             "kl_coef": 0.0, "lm_loss_coef": 0.0, "advantage_estimator": "group"},
    # Dr. GRPO (Liu et al. 2025): no std normalisation, each sequence's token sum divided by a
    # constant (the generation budget, sampling.max_new_tokens), ε = 0.2, no KL term.
    "dr_grpo": {"advantage_scale": "none", "loss_agg": "constant", "clip_low": 0.2, "clip_high": 0.2,
                "kl_coef": 0.0, "lm_loss_coef": 0.0, "advantage_estimator": "group"},
    # VAPO (Yue et al. 2025): a value model pretrained for 50 steps, decoupled GAE (λ_critic = 1,
    # λ_policy = 1 − 1/(0.05·l)), token-level loss, clip-higher, positive-example LM loss μ = 0.1,
    # no KL term; critic lr twice the actor's.
    "vapo": {"advantage_estimator": "gae", "loss_agg": "token", "clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.0, "lm_loss_coef": 0.1,
             "value": {"pretrain_steps": 50, "lambda_critic": 1.0, "lambda_alpha": 0.05, "gamma": 1.0}},
}


def with_preset(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a trainer section) over the preset its ``algorithm`` names; unknown names pass
    through for the field's own validation to reject."""
    preset = PRESETS.get(data.get("algorithm") or "")
    if preset is None:
        return data
    merged = {**preset, **data}
    if isinstance(data.get("value"), dict):
        merged["value"] = {**preset.get("value", {}), **data["value"]}
    return merged
