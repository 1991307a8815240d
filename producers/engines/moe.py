"""Rollout Routing Replay (R3) for mixture-of-experts policies: the router surgery the engine and the
trainer share.

Each mixture-of-experts layer's router picks ``top_k`` of ``num_experts`` experts per token. The rollout
engine records that choice (``Routers.record``); the trainer replays it in its forward (``Routers.replay``):
each router takes a plan's experts where the plan gives them and its own top-k elsewhere, and weights
them with its live probabilities, renormalised as the model's router does, so the router still learns.

Both are forward hooks on the routers, there only while a context is open: a dense model has no router
and pays nothing. Activation checkpointing (``trainer.logprobs.checkpoint_layers``) recomputes a layer
in the backward pass, once the context has closed: ``checkpoint_contexts`` gives ``torch.utils.checkpoint``
a context that re-applies, in the recomputation, the plan the layer's forward saw.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from broker.schema import RoutingShape

RENORMALISED: dict[str, bool | None] = {
    # norm_topk_prob: as the checkpoint's config says
    "Qwen2MoeTopKRouter": None, "Qwen3MoeTopKRouter": None, "Qwen3NextTopKRouter": None,
    "Qwen3OmniMoeThinkerTextTopKRouter": None, "Qwen3OmniMoeTalkerTextTopKRouter": None,
    "Qwen4ExpTextTopKRouter": None, "OlmoeTopKRouter": None, "FlexOlmoTopKRouter": None, "MellumTopKRouter": None,
    # always
    "MixtralTopKRouter": True, "MiniMaxTopKRouter": True, "Qwen3VLMoeTextTopKRouter": True,
    "Qwen3OmniMoeTextTopKRouter": True, "Qwen3_5MoeTopKRouter": True,
}
"""The routers rlbus records and replays, by class name: each computes ``logits = W h``, a softmax over the
experts, takes its top-k and returns ``(logits, scores, indices)``, the scores being the top-k probabilities,
renormalised to sum to one always (True) or when its ``norm_topk_prob`` is set (None)."""

MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Config fields that make a model a mixture of experts when above one."""

_PLAN = "_rlbus_replay_plan"  # on a router while a plan is applied: long [rows, top_k], or None
_RECOMPUTING = "_rlbus_recomputing"  # on a router while checkpointing recomputes its layer


def _rule(module: torch.nn.Module) -> str | None:
    """The known router class ``module`` is (or derives from, as FSDP's wrapper classes do), else None."""
    return next((k.__name__ for k in type(module).__mro__ if k.__name__ in RENORMALISED), None)


def routers_in(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The known routers inside ``module``, in module order (no check for unknown ones)."""
    return [m for m in module.modules() if _rule(m) is not None]


def _moe_config(model: torch.nn.Module) -> str | None:
    """``key=value`` of the first config field that says ``model`` is a mixture of experts, else None."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in MOE_CONFIG_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 1:
            return f"{key}={value}"
    return None


class Recorder:
    """The experts the routers selected in the forwards run while ``Routers.record`` is open."""

    def __init__(self, shape: RoutingShape) -> None:
        self.shape = shape
        self._seen: list[list[torch.Tensor]] = [[] for _ in range(shape.layers)]

    def _hook(self, layer: int, router: torch.nn.Module, _args: Any, output: tuple) -> None:
        if not vars(router).get(_RECOMPUTING):  # a checkpointed layer's recomputation is not a new forward
            self._seen[layer].append(output[2].detach())

    def take(self) -> torch.Tensor:
        """long [rows, layers, top_k]: each flattened row's experts (rows of a forward over [B, S] tokens are
        ``b * S + s``), in increasing order, for the forwards since the previous ``take``, one after another."""
        calls = {len(seen) for seen in self._seen}
        if len(calls) != 1:
            raise RuntimeError(f"the MoE routers ran {sorted(calls)} times in the same forwards: something skipped "
                               "some (a hub kernel replacing the MoE block?); routing cannot be recorded")
        if not calls.pop():
            return torch.empty(0, self.shape.layers, self.shape.top_k, dtype=torch.long)
        experts = torch.stack([torch.cat(seen) for seen in self._seen], dim=1).sort(dim=-1).values
        self._seen = [[] for _ in range(self.shape.layers)]
        return experts


class _Replaying:
    """Applies one plan (or None) to each router while entered; re-enterable, one entry at a time."""

    def __init__(self, routers: list[torch.nn.Module], plans: list[torch.Tensor | None], *, recomputing: bool) -> None:
        self.routers, self.plans, self.recomputing = routers, plans, recomputing
        self._saved: list[dict] = []
        self._handles: list = []

    def __enter__(self) -> _Replaying:
        self._saved = [{k: vars(r)[k] for k in (_PLAN, _RECOMPUTING) if k in vars(r)} for r in self.routers]
        for router, plan in zip(self.routers, self.plans, strict=True):
            vars(router)[_PLAN], vars(router)[_RECOMPUTING] = plan, self.recomputing
            if plan is not None:  # first among the hooks, so that a recording sees the replayed choice
                self._handles.append(router.register_forward_hook(_replay_hook, prepend=True))
        return self

    def __exit__(self, *_exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for router, saved in zip(self.routers, self._saved, strict=True):
            for key in (_PLAN, _RECOMPUTING):
                vars(router).pop(key, None)
            vars(router).update(saved)


def _replay_hook(router: torch.nn.Module, _args: Any, output: tuple) -> tuple | None:
    """The router's output with its plan's experts where given (two hooks on one router read the same
    plan, and replaying twice gives the same output)."""
    plan = vars(router).get(_PLAN)
    if plan is None:
        return None
    logits, scores, indices = output
    if plan.shape[0] != indices.shape[0]:
        raise ValueError(f"routing replay: a plan of {plan.shape[0]} positions for a router call over "
                         f"{indices.shape[0]} tokens; a plan is [batch, sequence, layers, top_k] of the call it wraps")
    plan = plan.to(indices.device)
    given = plan[:, :1] >= 0
    chosen = torch.where(given, plan, indices)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, chosen)
    renormalise = RENORMALISED[_rule(router)]
    if renormalise or (renormalise is None and router.norm_topk_prob):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, torch.where(given, weights.to(scores.dtype), scores), chosen


class Routers:
    """A model's mixture-of-experts routers, in layer order, and their ``RoutingShape``."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        kinds = {(int(m.top_k), int(m.num_experts)) for m in modules}
        if len(kinds) != 1:
            raise ValueError(f"MoE routers of unequal shapes (top_k, num_experts) {sorted(kinds)}: one RoutingShape "
                             "cannot describe them")
        ((top_k, experts),) = kinds
        self.modules = modules
        self.shape = RoutingShape(layers=len(modules), top_k=top_k, num_experts=experts)

    @contextlib.contextmanager
    def record(self):
        """A ``Recorder`` of every forward through the model while open (the experts the routers chose,
        replayed ones included)."""
        recorder = Recorder(self.shape)
        handles = [m.register_forward_hook(functools.partial(recorder._hook, i)) for i, m in enumerate(self.modules)]
        try:
            yield recorder
        finally:
            for handle in handles:
                handle.remove()

    def replay(self, plan: torch.Tensor) -> _Replaying:
        """A context in which each router call over [B, S] tokens routes token (b, s) of MoE layer l to
        ``plan[b, s, l]`` (int [B, S, layers, top_k]) where that row is given, and by its own top-k where it
        is all -1; the scores are the live probabilities at those experts, renormalised as the router does."""
        shape = self.shape
        if plan.dim() != 4 or tuple(plan.shape[2:]) != (shape.layers, shape.top_k):
            raise ValueError(f"routing plan of shape {tuple(plan.shape)}: this model needs [batch, sequence, "
                             f"{shape.layers}, {shape.top_k}] (its MoE layers, its top-k)")
        given = plan >= 0
        out_of_range, partial = torch.stack([((plan < -1) | (plan >= shape.num_experts)).any(),
                                             (given.any(-1) & ~given.all(-1)).any()]).tolist()
        if out_of_range:
            raise ValueError(f"routing plan holds expert ids outside 0..{shape.num_experts - 1} and -1 (route live): "
                             "was it recorded with another model?")
        if partial:
            raise ValueError("routing plan has positions with some experts given and some -1: each position's "
                             "top_k experts are all given or all -1")
        rows = plan.shape[0] * plan.shape[1]
        plans = [plan[:, :, layer].reshape(rows, shape.top_k).long() for layer in range(shape.layers)]
        return _Replaying(self.modules, plans, recomputing=False)


def find_routers(model: torch.nn.Module) -> Routers | None:
    """``model``'s routers in layer order; None for a dense model. A mixture-of-experts model whose
    router rlbus does not know how to replay is refused (ValueError)."""
    moe = _moe_config(model)
    routers, unknown = [], set()
    for module in model.modules():
        name = type(module).__name__
        if _rule(module) is not None:
            routers.append(module)
        elif name.endswith("Router") or (moe and name.endswith("Gate")):
            unknown.add(name)
    if unknown or (moe and not routers):
        found = (f"router {', '.join(sorted(unknown))}" if unknown
                 else f"config ({moe}) but no router module rlbus knows")
        raise ValueError(f"{type(model).__name__} is a mixture-of-experts model with {found}: rlbus records and "
                         "replays only softmax top-k routers (Qwen2/3-MoE, OLMoE, Mixtral and their kin, "
                         "producers.engines.moe.RENORMALISED); use such a policy, or add this router's rule there")
    return Routers(routers) if routers else None


def routing_shape(model: torch.nn.Module) -> RoutingShape | None:
    """The routing ``model`` records (None: a dense model); refuses an MoE router it cannot replay."""
    routers = find_routers(model)
    return None if routers is None else routers.shape


def replay(model: torch.nn.Module, plan: torch.Tensor | None) -> contextlib.AbstractContextManager:
    """``find_routers(model).replay(plan)``; nothing when ``plan`` is None. A plan for a dense model is refused."""
    if plan is None:
        return contextlib.nullcontext()
    routers = find_routers(model)
    if routers is None:
        raise ValueError(f"a routing plan for {type(model).__name__}, a dense model: the batch's routing was recorded "
                         "by a mixture-of-experts policy, not this one")
    return routers.replay(plan)


def checkpoint_contexts(routers: list[torch.nn.Module]) -> tuple[contextlib.AbstractContextManager, _Replaying]:
    """``context_fn`` of ``torch.utils.checkpoint`` for a layer holding ``routers``: called at the layer's
    forward, it keeps the plans applied then, and re-applies them in the recomputation."""
    plans = [vars(r).get(_PLAN) for r in routers]
    return contextlib.nullcontext(), _Replaying(routers, plans, recomputing=True)
