"""The sorting example: sort the digits of a string (``3142=`` → ``1234``), scored by exact match.

A second toy task for the scratch model of ``rlbus.examples.addition`` (same character tokenizer,
same warm-up), made for the solver + verifier workflow: judging a proposed sort takes only local
checks (each digit no larger than the next, the same digits as the question), and a verifier of
the example's size learns to judge it under RL; judging a proposed sum needs the sum itself, and
at this size it does not learn that even from supervised data (see ``configs/solver_verifier.toml``).
"""

from __future__ import annotations

import random
from pathlib import Path

from rlbus.examples.addition import AdditionConfig, AdditionTask, write_split

TASK = "rlbus.examples.sorting:SortTask"
"""Import path of the task, as ``run.task`` names it (short name ``sort``)."""


class SortTask(AdditionTask):
    """``3142=`` prompts; the completion must be the same digits in ascending order and nothing else
    (addition's exact match)."""

    name = "sort"

    def write_example_dataset(self, out_dir: Path, config: AdditionConfig, *, seed: int) -> tuple[Path, Path]:
        """The example's data for this task: ``config.sort_prompts`` strings of ``config.sort_length``
        digits, ``config.n_heldout`` of them held out."""
        return write_dataset(out_dir, seed=seed, length=config.sort_length, n_prompts=config.sort_prompts,
                             n_heldout=config.n_heldout)


def write_dataset(out_dir: Path, *, seed: int, length: int, n_prompts: int, n_heldout: int) -> tuple[Path, Path]:
    """Write ``n_prompts`` distinct digit strings of ``length`` (all of them when there are fewer),
    split by a seeded shuffle into train and held-out, so that no held-out prompt is trained on.
    Returns the paths of ``train.jsonl`` and ``heldout.jsonl``."""
    if length < 2:
        raise ValueError(f"sort_length={length}: a string to sort needs at least 2 digits")
    rng = random.Random(seed)
    total = 10**length
    count = min(n_prompts, total)
    if not 0 <= n_heldout < count:
        raise ValueError(f"n_heldout={n_heldout} must be in [0, {count}) for {count} prompts")
    strings = [str(n).zfill(length) for n in rng.sample(range(total), count)]
    rows = [{"prompt_id": f"sort-{s}", "prompt": f"{s}=", "answer": "".join(sorted(s))} for s in strings]
    return write_split(out_dir, rows, n_heldout, "sorting")
