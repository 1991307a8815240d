"""Tasks score completions. A run names its task by import path, ``package.module:Class`` (the
run config also takes short names for the built-in ones), with keyword ``params`` for the class;
a task needs a ``name`` (stamped on every record) and ``score``.

Built in: ``producers.tasks.math:MathTask``, ``producers.tasks.code:CodeTask``,
``producers.tasks.gym:ReasoningGymTask``. ``answer`` is a string: the reference answer, or for
tasks that need more (a program's tests, a generator's entry) a JSON document the task reads.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Task(Protocol):
    """Scores one completion of one prompt."""

    name: str

    def score(self, prompt: str, completion: str, answer: str) -> float:
        """The reward of ``completion`` (decoded text, special tokens removed) for ``prompt``."""
        ...


class TaskError(ValueError):
    """A task reference that cannot be loaded; the message says what to write instead."""

    retriable = False


class AnswerError(ValueError):
    """An item whose reference ``answer`` the task cannot use (bad JSON, missing tests): the prompt
    is bad input, and goes to the DLQ with this message. A wrong or unparseable *completion* is
    never an error: it scores 0."""

    retriable = False


def load_task(ref: str, params: dict[str, Any] | None = None) -> Task:
    """The task ``ref`` (``package.module:Class``) names, built with ``params``."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise TaskError(f"task {ref!r}: name a task by its import path, 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(f"task {ref!r}: cannot import {module_name!r} ({exc}); is it installed?") from exc
    cls = getattr(module, attr, None)
    if cls is None:
        raise TaskError(f"task {ref!r}: module {module_name!r} has no attribute {attr!r}")
    try:
        task = cls(**(params or {}))
    except (TypeError, ValueError) as exc:
        raise TaskError(f"task {ref!r} with params {params or {}}: {exc}") from exc
    if not isinstance(task, Task):
        raise TaskError(f"task {ref!r}: {attr} needs a 'name' and a 'score(prompt, completion, answer)' method")
    return task
