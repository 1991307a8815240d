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

``merge`` names what makes two steps the same:

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


class StepCredit(GroupStage):
    """SALT: merge identical steps of the group's episodes into a graph; the trainer gives each turn
    the mean outcome advantage of the samples through its node. Groups without turns pass as they are."""

    name = "step_credit"
    counter_names = ("modified_samples", "steps", "shared_steps", "nodes")

    class Config(StageConfig):
        merge: Literal["history", "state"] = Field(
            default="history",
            description="What makes two steps one node: 'history' (the same episode up to and including the action: "
            "the prefix tree of the group) or 'state' (the same observation answered with the same action, wherever "
            "in the episode).")

    def process(self, groups: list[TrajectoryGroup], *, version: int) -> list[TrajectoryGroup]:
        out = []
        for group in groups:
            if group.header.turns is None:
                out.append(group)
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
