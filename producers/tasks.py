"""Tasks score completions. A run names its task by import path, ``package.module:Class``; the
class is built without arguments and needs a ``name`` (stamped on every record) and ``score``."""

from __future__ import annotations

import importlib
from typing import Protocol, runtime_checkable


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


def load_task(ref: str) -> Task:
    """The task ``ref`` (``package.module:Class``) names, built."""
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
    task = cls()
    if not isinstance(task, Task):
        raise TaskError(f"task {ref!r}: {attr} needs a 'name' and a 'score(prompt, completion, answer)' method")
    return task
