"""Semantic checks of a trajectory group: the columns agree with each other and with the header.

Used by ``broker.codec`` on both encode (a producer learns of its bug before publishing) and
decode (a consumer never trains on a record that breaks these rules). A mixture-of-experts group's
``routed_experts`` (under the key of that name, absent or None for a dense group) is checked against
``header.routing``.
"""

from __future__ import annotations

import math

import numpy as np

from broker.errors import RecordError
from broker.schema import TrajectoryHeader

PER_TOKEN_COLUMNS = ("completion_tokens", "behaviour_logprobs", "token_versions", "loss_mask")


def check_group(header: TrajectoryHeader, columns: dict[str, np.ndarray], *, vocab_size: int | None) -> None:
    """Raise ``RecordError`` naming the first rule the group breaks."""
    check_offsets(header, columns["completion_offsets"], len(columns["completion_tokens"]))
    lengths = {name: len(columns[name]) for name in PER_TOKEN_COLUMNS}
    if len(set(lengths.values())) != 1:
        raise RecordError(f"per-token columns differ in length: {lengths}")
    for name in ("prompt_tokens", "completion_tokens"):
        _check_token_ids(name, columns[name], header.vocab_size, "header vocab_size")
        if vocab_size is not None:
            _check_token_ids(name, columns[name], vocab_size, "consumer vocab_size")
    _check_logprobs(columns["behaviour_logprobs"])
    _check_versions(header, columns["token_versions"])
    mask = columns["loss_mask"]
    bad = np.flatnonzero(mask > 1)
    if bad.size:
        raise RecordError(f"loss_mask must be 0 or 1: value {int(mask[bad[0]])} at token {int(bad[0])}")
    for i, reward in enumerate(header.rewards):
        if not math.isfinite(reward):
            raise RecordError(f"reward of sample {i} is not finite: {reward}")
    routed = columns.get("routed_experts")
    problem = routing_problem(header, routed, len(columns["prompt_tokens"]), lengths["loss_mask"])
    if problem:
        raise RecordError(problem)


def routing_problem(header: TrajectoryHeader, routed: np.ndarray | None, prompt_len: int, n_tokens: int) -> str | None:
    """What is wrong with a group's ``routed_experts`` (int16 [P - 1 + T, layers, top_k]) against its header's
    ``routing``, or None: present exactly when the header has routing, of its shape, each row's experts
    strictly increasing ids below ``num_experts`` in every layer, or the whole row -1 (not recorded)."""
    shape = header.routing
    if shape is None:
        return None if routed is None else "routed_experts without header.routing: set its RoutingShape, or drop them"
    if routed is None:
        return "header.routing is set but the group has no routed_experts (a dense policy's header has routing None)"
    if prompt_len < 1:
        return "routed_experts need a prompt of at least one token (its last position routes first tokens)"
    want = (prompt_len - 1 + n_tokens, shape.layers, shape.top_k)
    if routed.shape != want:
        return (
            f"routed_experts has shape {list(routed.shape)}, expected [P - 1 + T, layers, top_k] = {list(want)} "
            f"(P = {prompt_len} prompt tokens, T = {n_tokens} completion tokens, header.routing)"
        )
    if routed.size == 0:
        return None
    unrecorded = routed == -1
    row_unrecorded = unrecorded.all(axis=(1, 2))
    partial = np.flatnonzero(unrecorded.any(axis=(1, 2)) & ~row_unrecorded)
    if partial.size:
        row = int(partial[0])
        layer = int(np.flatnonzero(unrecorded[row].any(axis=1))[0])
        return f"routed_experts row {row} is partly -1 (layer {layer}): a row is all -1 (not recorded) or all experts"
    ids = routed[~row_unrecorded]
    rows = np.flatnonzero(~row_unrecorded)
    bad = np.argwhere((ids < 0) | (ids >= shape.num_experts))
    if bad.size:
        at, layer, rank = (int(x) for x in bad[0])
        value = int(ids[at, layer, rank])
        return (
            f"routed_experts has expert id {value} at row {int(rows[at])}, layer {layer}: ids are -1 (a row not "
            f"recorded) or below header.routing.num_experts {shape.num_experts}"
        )
    bad = np.argwhere(np.diff(ids.astype(np.int32), axis=2) <= 0)
    if bad.size:
        at, layer = int(bad[0][0]), int(bad[0][1])
        return (
            f"routed_experts row {int(rows[at])}, layer {layer}: experts {ids[at, layer].tolist()} are not strictly "
            "increasing (each layer's top_k experts sorted, no duplicates)"
        )
    return None


def check_offsets(header: TrajectoryHeader, offsets: np.ndarray, n_tokens: int) -> None:
    if len(offsets) < 2:
        raise RecordError(f"completion_offsets needs at least 2 entries (G + 1), got {len(offsets)}")
    if offsets[0] != 0:
        raise RecordError(f"completion_offsets must start at 0, starts at {int(offsets[0])}")
    steps = np.diff(offsets.astype(np.int64))
    if steps.size and steps.min() < 0:
        at = int(np.flatnonzero(steps < 0)[0])
        raise RecordError(f"completion_offsets not monotonic: {int(offsets[at])} then {int(offsets[at + 1])}")
    if offsets[-1] != n_tokens:
        raise RecordError(
            f"completion_offsets ends at {int(offsets[-1])} but completion_tokens has {n_tokens} tokens"
        )
    group_size = len(offsets) - 1
    if not group_size == len(header.rewards) == len(header.finish_reasons):
        raise RecordError(
            f"group size disagrees: {group_size} samples from offsets, {len(header.rewards)} rewards, "
            f"{len(header.finish_reasons)} finish reasons"
        )
    if header.subgroups is not None and len(header.subgroups) != group_size:
        raise RecordError(f"group size disagrees: {group_size} samples from offsets, {len(header.subgroups)} subgroups")
    problem = turns_problem(header, steps)
    if problem:
        raise RecordError(problem)


def turns_problem(header: TrajectoryHeader, lengths: np.ndarray) -> str | None:
    """What is wrong with the header's turn spans and graph nodes for samples of ``lengths`` tokens, or
    None: spans ordered, not overlapping and inside their sample; one node per turn."""
    turns, nodes, bonus = header.turns, header.turn_nodes, header.turn_advantages
    if turns is None:
        return "turn_nodes or turn_advantages without turns" if nodes is not None or bonus is not None else None
    if len(turns) != len(lengths):
        return f"group size disagrees: {len(lengths)} samples from offsets, turns for {len(turns)}"
    for i, spans in enumerate(turns):
        end = 0
        for span in spans:
            if len(span) != 2 or not end <= span[0] < span[1] <= lengths[i]:
                return f"sample {i}'s turn {span} is not an ordered [start, end) inside its {int(lengths[i])} tokens"
            end = span[1]
    if nodes is not None and [len(n) for n in nodes] != [len(t) for t in turns]:
        return "turn_nodes must name one node per turn of each sample"
    if bonus is not None:
        if [len(a) for a in bonus] != [len(t) for t in turns]:
            return "turn_advantages must give one advantage per turn of each sample"
        if not all(math.isfinite(a) for row in bonus for a in row):
            return "turn_advantages must be finite"
    return None


def _check_token_ids(name: str, tokens: np.ndarray, vocab_size: int, source: str) -> None:
    if tokens.size == 0:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0:
        raise RecordError(f"{name} has negative token id {low}")
    if high >= vocab_size:
        raise RecordError(f"{name} has token id {high} >= {source} {vocab_size}")


def _check_logprobs(logprobs: np.ndarray) -> None:
    finite = np.isfinite(logprobs)
    if not finite.all():
        at = int(np.flatnonzero(~finite)[0])
        raise RecordError(f"behaviour_logprobs not finite at token {at}: {float(logprobs[at])}")
    positive = np.flatnonzero(logprobs > 0)
    if positive.size:
        at = int(positive[0])
        raise RecordError(f"behaviour_logprobs must be <= 0: {float(logprobs[at])} at token {at}")


def _check_versions(header: TrajectoryHeader, versions: np.ndarray) -> None:
    if header.min_version > header.max_version:
        raise RecordError(f"min_version {header.min_version} > max_version {header.max_version}")
    if versions.size == 0:
        return
    low, high = int(versions.min()), int(versions.max())
    if low < header.min_version or high > header.max_version:
        raise RecordError(
            f"token_versions span [{low}, {high}], outside the header's "
            f"[min_version {header.min_version}, max_version {header.max_version}]"
        )
