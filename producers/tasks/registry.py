"""The short names ``run.task`` accepts for the built-in tasks, besides an import path
``package.module:Class`` and ``reasoning_gym:<dataset>``.

Every entry is an import path, not a class: a run config is validated without importing a task
module (``load_task`` imports it when the task is built). The two example tasks live in
``rlbus/examples/``, kept out of the core packages, and are named here by their path only.
"""

from __future__ import annotations

TASKS: dict[str, str] = {
    "addition": "rlbus.examples.addition:AdditionTask",
    "sort": "rlbus.examples.sorting:SortTask",
    "math": "producers.tasks.math:MathTask",
    "code": "producers.tasks.code:CodeTask",
    "tool": "producers.tasks.tool:ToolTask",
    "textgame": "producers.tasks.textgame:TextGameTask",
    "sql": "producers.tasks.sql:SqlTask",
    "shell": "producers.tasks.shell:ShellTask",
    "multihop": "producers.tasks.multihop:MultiHopTask",
}
"""Short task names and the task each names."""

GYM_PREFIX = "reasoning_gym:"
"""``reasoning_gym:<dataset>`` names the reasoning-gym task over one of its datasets."""
GYM_TASK = "producers.tasks.gym:ReasoningGymTask"
"""The task a ``reasoning_gym:<dataset>`` name stands for (``dataset`` goes into its params)."""
