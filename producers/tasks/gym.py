"""``reasoning_gym:<dataset>``: procedural tasks generated offline by reasoning-gym, scored by the
generator's own verifier.

``write_reasoning_gym_dataset`` writes train and held-out JSONL files: each line's ``prompt`` is the
entry's question and its ``answer`` the whole entry as JSON (question, answer, metadata), which the
verifier needs. ``ReasoningGymTask`` reads the model's answer from the last ``<answer>...</answer>``
of the completion, or else its last non-empty line, and scores it with the dataset's
``score_answer`` (clamped to [0, 1]). A verifier that fails on a completion scores it 0.

Some verifiers evaluate the model's text (countdown and puzzle24 through sympy's ``parse_expr``,
where ``9**9**9`` never ends), so every verifier runs in worker processes of a
``producers.tasks.bounded.BoundedPool``, killed past ``timeout_s``: a score never hangs a thread.
That bounds time, not trust: ``parse_expr`` is ``eval``, and a worker is no sandbox.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from producers.tasks import AnswerError
from producers.tasks.bounded import BoundedCallError, BoundedPool

logger = logging.getLogger(__name__)


def _datasets() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _check_name(dataset: str) -> None:
    names = _datasets()
    if dataset not in names:
        close = [n for n in names if dataset.split("_")[0] in n][:8] or names[:8]
        raise ValueError(f"reasoning-gym has no dataset {dataset!r}; e.g. {', '.join(close)} ({len(names)} in all)")


def write_reasoning_gym_dataset(
    out_dir: Path, *, dataset: str, size: int, seed: int, n_heldout: int, config: dict[str, Any] | None = None
) -> tuple[Path, Path]:
    """Generate ``size`` entries; write ``train.jsonl`` and ``heldout.jsonl`` (the first ``n_heldout``
    distinct questions; train has the other distinct ones, none of them a held-out question). A line's
    ``prompt_id`` is ``<dataset>-<index in the generated list>``. Returns both paths."""
    import reasoning_gym

    _check_name(dataset)
    try:
        entries = list(reasoning_gym.create_dataset(dataset, size=size, seed=seed, **(config or {})))
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"reasoning-gym dataset {dataset!r} with config {config or {}}: {exc}") from None
    unique: dict[str, tuple[int, dict]] = {}
    for index, entry in enumerate(entries):
        unique.setdefault(entry["question"], (index, entry))
    if len(unique) <= n_heldout:
        raise ValueError(f"reasoning-gym {dataset!r} gave {len(unique)} distinct questions for n_heldout={n_heldout}: "
                         "raise size or widen the dataset's config")
    ordered = list(unique.values())
    splits = {"heldout.jsonl": ordered[:n_heldout], "train.jsonl": ordered[n_heldout:]}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, split in splits.items():
        with (out_dir / name).open("w", encoding="utf-8") as fh:
            for index, entry in split:
                try:  # default=str: sets, dates and the like in metadata become strings
                    answer = json.dumps(entry, sort_keys=True, default=str)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"reasoning-gym {dataset!r}: entry {index} is not JSON ({exc})") from None
                row = {"prompt_id": f"{dataset}-{index}", "prompt": entry["question"], "answer": answer}
                fh.write(json.dumps(row) + "\n")
    logger.info("wrote %d train and %d held-out %s prompts to %s", len(splits["train.jsonl"]), n_heldout, dataset,
                out_dir)
    return out_dir / "train.jsonl", out_dir / "heldout.jsonl"


@functools.lru_cache(maxsize=None)
def _scorer(dataset: str) -> Callable[[str, dict], float]:
    """In a worker: the dataset's ``score_answer``, built once (some datasets load word lists)."""
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(dataset)


def _score_in_worker(dataset: str, given: str, entry: dict) -> float:
    return float(_scorer(dataset)(given, entry))


class ReasoningGymTask:
    """A reasoning-gym dataset's verifier on the model's final answer."""

    def __init__(self, dataset: str, answer_tag: str = "answer", timeout_s: float = 10.0) -> None:
        _check_name(dataset)
        if not re.fullmatch(r"[A-Za-z_][\w.-]*", answer_tag):
            raise ValueError(f"answer_tag {answer_tag!r} must be a tag name such as 'answer' (letters, digits, _ . -)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s {timeout_s} must be positive")
        self.dataset = dataset
        self.name = f"reasoning_gym:{dataset}"
        self._tagged = re.compile(rf"<{re.escape(answer_tag)}>(.*?)</{re.escape(answer_tag)}>", re.S)
        self._pool = BoundedPool(timeout_s=timeout_s, warmup=functools.partial(_scorer, dataset))
        self._logged = False

    def demonstration(self, answer: str) -> str:
        """What a correct completion looks like (the entry's answer), for a supervised warm-up."""
        return str(self._entry(answer)["answer"])

    def _entry(self, answer: str) -> dict:
        try:
            entry = json.loads(answer)
        except json.JSONDecodeError:
            raise AnswerError(f"{self.name}: the answer is not a reasoning-gym entry in JSON; write the dataset with "
                              "data.reasoning_gym (or write_reasoning_gym_dataset)") from None
        if not isinstance(entry, dict) or "answer" not in entry or "metadata" not in entry:
            raise AnswerError(f"{self.name}: the answer JSON lacks the entry's 'answer' and 'metadata'; write the "
                              "dataset with data.reasoning_gym (or write_reasoning_gym_dataset)")
        return entry

    def model_answer(self, completion: str) -> str:
        """The text in the last answer tags, else the last non-empty line, stripped."""
        tagged = self._tagged.findall(completion)
        if tagged:
            return tagged[-1].strip()
        lines = [line.strip() for line in completion.splitlines() if line.strip()]
        return lines[-1] if lines else ""

    def score(self, prompt: str, completion: str, answer: str) -> float:
        entry = self._entry(answer)
        try:
            return min(1.0, max(0.0, self._pool.call(_score_in_worker, self.dataset, self.model_answer(completion),
                                                     entry)))
        except BoundedCallError as exc:  # the verifier failing on a completion is the completion's fault: 0
            if not self._logged:  # once per task, not per completion (a benign race may log it twice)
                self._logged = True
                logger.debug("%s: the verifier failed on a completion (%s); it scores 0", self.name, exc)
            return 0.0

    def close(self) -> None:
        """Stop the verifier worker processes (they also end with this process)."""
        self._pool.close()
