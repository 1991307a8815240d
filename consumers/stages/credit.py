"""Step-level credit for multi-turn episodes from the group's own trajectories (SALT).

Group algorithms (GRPO, DAPO, Dr. GRPO) give every token of an episode its outcome advantage, so a
step every episode took (opening the door all of them opened) is pushed up in the winners and down
in the losers. ``StepCredit`` builds the group's trajectory graph: each turn of each sample is a step
(the state it was taken in, the action), and identical steps across the group's samples are merged
into one node. The trainer then gives every token of a turn the mean outcome advantage of the
samples that pass through that turn's node: a step all samples share averages to the group's mean
advantage (zero: no credit either way), a step only the winners took keeps theirs, and the
decisive step where a loser left the winners' path carries its own outcome.

The stage only writes the graph (``header.turn_nodes``: per sample, per turn, a node id); the
advantages are the algorithm's own (mean-centred, ÷ std or not, per subgroup), averaged over each
node in ``trainer.batch.step_advantages``, so it composes with every group estimator.

``method = "gigpo"`` groups steps by anchor state instead (GiGPO): the steps of the group's episodes
taken from the same observation are compared by their discounted return (the episode's reward times
``gamma`` per turn left after the step), centred on their anchor group's mean (÷ its std with
``scale = "std"``); that step advantage, times ``weight``, goes to ``header.turn_advantages`` and the
trainer adds it to every token of the turn, on top of the episode's own advantage. A step alone in
its anchor group gets none.

``merge`` (SALT) names what makes two steps the same:

* ``history``: the whole episode up to and including the action (every earlier action and
  observation, token for token): the graph is the prefix tree of the group's episodes. Exact in any
  environment.
* ``state``: the observation the action answered (the prompt, for the first turn) and the action,
  wherever in the episode they happen: episodes that reach the same observation by different paths
  share the step there (a cycle or a detour counts once per sample). Right where an observation
  is the whole state, as in text games that describe the room and what is in it.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from broker.schema import TrajectoryGroup
from consumers.stages.base import GroupStage, StageConfig, replace_group


def step_nodes(group: TrajectoryGroup, merge: Literal["history", "state"]) -> list[list[int]]:
    """Per sample, per turn, the id (0, 1, ... in order of first sight) of its node in the group's
    trajectory graph."""
    turns = group.header.turns
    if turns is None:
        raise ValueError(f"group {group.header.group_id} has no turns: step credit needs multi-turn episodes")
    ids: dict[tuple, int] = {}
    nodes = []
    for i, spans in enumerate(turns):
        tokens = group.completion_tokens[group.sample(i)]
        previous_end, parent, row = 0, -1, []
        for start, end in spans:
            observed, action = tokens[previous_end:start].tobytes(), tokens[start:end].tobytes()
            key = (parent, observed, action) if merge == "history" else (observed, action)
            node = ids.setdefault(key, len(ids))
            row.append(node)
            previous_end, parent = end, node
        nodes.append(row)
    return nodes


def anchor_advantages(group: TrajectoryGroup, *, gamma: float, scale: Literal["std", "none"]) -> list[list[float]]:
    """GiGPO's step advantages: per sample, per turn, the turn's discounted return (reward × gamma per
    turn after it) minus the mean over the steps taken from the same observation (÷ their std)."""
    turns = group.header.turns
    if turns is None:
        raise ValueError(f"group {group.header.group_id} has no turns: step credit needs multi-turn episodes")
    anchors: dict[bytes, list[tuple[int, int, float]]] = {}
    for i, spans in enumerate(turns):
        tokens, previous_end = group.completion_tokens[group.sample(i)], 0
        for k, (start, end) in enumerate(spans):
            ret = group.header.rewards[i] * gamma ** (len(spans) - 1 - k)
            anchors.setdefault(tokens[previous_end:start].tobytes(), []).append((i, k, ret))
            previous_end = end
    out = [[0.0] * len(spans) for spans in turns]
    for steps in anchors.values():
        if len(steps) < 2:
            continue
        returns = np.asarray([r for _, _, r in steps])
        centred = returns - returns.mean()
        if scale == "std":
            centred = centred / (returns.std(ddof=1) + 1e-6)
        for (i, k, _), a in zip(steps, centred):
            out[i][k] = float(a)
    return out


class StepCredit(GroupStage):
    """Step-level credit from the group's own episodes: SALT's trajectory graph (the trainer gives each
    turn the mean outcome advantage of the samples through its node) or GiGPO's anchor states (a
    step advantage per turn, added). Groups without turns pass as they are."""

    name = "step_credit"
    counter_names = ("modified_samples", "steps", "shared_steps", "nodes")

    class Config(StageConfig):
        method: Literal["salt", "gigpo"] = Field(
            default="salt", description="'salt': average outcome advantages over the trajectory graph's nodes; "
            "'gigpo': add a step advantage from the steps taken at the same observation.")
        merge: Literal["history", "state"] = Field(
            default="history",
            description="salt: what makes two steps one node: 'history' (the same episode up to and including the "
            "action: the prefix tree of the group) or 'state' (the same observation answered with the same action, "
            "wherever in the episode).")
        gamma: float = Field(default=0.95, ge=0.0, le=1.0, description="gigpo: discount per turn of a step's return.")
        weight: float = Field(default=1.0, ge=0.0, description="gigpo: ω, the step advantage's weight.")
        scale: Literal["std", "none"] = Field(
            default="std", description="gigpo: divide a step advantage by its anchor group's std, or not.")

    def process(self, groups: list[TrajectoryGroup], *, version: int) -> list[TrajectoryGroup]:
        out = []
        for group in groups:
            if group.header.turns is None:
                out.append(group)
                continue
            if self.config.method == "gigpo":
                bonus = anchor_advantages(group, gamma=self.config.gamma, scale=self.config.scale)
                bonus = [[a * self.config.weight for a in row] for row in bonus]
                self.count("steps", sum(len(row) for row in bonus))
                self.count("shared_steps", sum(a != 0 for row in bonus for a in row))
                self.count("modified_samples", group.group_size)
                out.append(replace_group(group, header={"turn_advantages": bonus}))
                continue
            nodes = step_nodes(group, self.config.merge)
            flat = np.asarray([n for row in nodes for n in row], dtype=np.int64)
            if flat.size:
                samples = np.asarray([i for i, row in enumerate(nodes) for _ in row], dtype=np.int64)
                pairs = np.unique(np.stack([flat, samples]), axis=1)  # each sample counted once per node
                through = np.bincount(pairs[0])
                self.count("steps", flat.size)
                self.count("shared_steps", int((through[flat] > 1).sum()))
                self.count("nodes", through.size)
            self.count("modified_samples", group.group_size)
            out.append(replace_group(group, header={"turn_nodes": nodes}))
        return out
