"""``reasoning_gym:<dataset>``: procedural tasks generated offline by reasoning-gym, scored by the
generator's own verifier.

``write_reasoning_gym_dataset`` writes train and held-out JSONL files: each line's ``prompt`` is the
entry's question and its ``answer`` the whole entry as JSON (question, answer, metadata), which the
verifier needs. ``ReasoningGymTask`` reads the model's answer from the last ``<answer>...</answer>``
of the completion, or else its last non-empty line, and scores it with the dataset's
``score_answer`` (clamped to [0, 1]). A verifier that fails on a completion scores it 0.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from producers.tasks import AnswerError

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
    """Generate ``size`` entries; write ``train.jsonl`` and ``heldout.jsonl`` (``n_heldout`` entries
    whose questions never appear in train). Returns both paths."""
    import reasoning_gym

    _check_name(dataset)
    try:
        entries = list(reasoning_gym.create_dataset(dataset, size=size, seed=seed, **(config or {})))
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"reasoning-gym dataset {dataset!r} with config {config or {}}: {exc}") from None
    unique: dict[str, dict] = {}
    for entry in entries:
        unique.setdefault(entry["question"], entry)
    if len(unique) <= n_heldout:
        raise ValueError(f"reasoning-gym {dataset!r} gave {len(unique)} distinct questions for n_heldout={n_heldout}: "
                         "raise size or widen the dataset's config")
    ordered = list(unique.values())
    splits = {"heldout.jsonl": ordered[:n_heldout], "train.jsonl": ordered[n_heldout:]}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, split in splits.items():
        with (out_dir / name).open("w", encoding="utf-8") as fh:
            for i, entry in enumerate(split):
                try:
                    answer = json.dumps(entry, sort_keys=True, default=str)
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"reasoning-gym {dataset!r}: an entry is not JSON ({exc})") from None
                row = {"prompt_id": f"{dataset}-{name.split('.')[0]}-{i}", "prompt": entry["question"], "answer": answer}
                fh.write(json.dumps(row) + "\n")
    logger.info("wrote %d train and %d held-out %s prompts to %s", len(splits["train.jsonl"]), n_heldout, dataset,
                out_dir)
    return out_dir / "train.jsonl", out_dir / "heldout.jsonl"


class ReasoningGymTask:
    """A reasoning-gym dataset's verifier on the model's final answer."""

    def __init__(self, dataset: str, answer_tag: str = "answer") -> None:
        _check_name(dataset)
        import reasoning_gym

        self.dataset = dataset
        self.name = f"reasoning_gym:{dataset}"
        self._score = reasoning_gym.get_score_answer_fn(dataset)
        self._tagged = re.compile(rf"<{re.escape(answer_tag)}>(.*?)</{re.escape(answer_tag)}>", re.S)
        self._warned = False

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
            raise AnswerError(f"{self.name}: the answer JSON lacks the entry's 'answer' and 'metadata'")
        return entry

    def score(self, prompt: str, completion: str, answer: str) -> float:
        entry = self._entry(answer)
        tagged = self._tagged.findall(completion)
        lines = [line.strip() for line in completion.splitlines() if line.strip()]
        given = tagged[-1].strip() if tagged else (lines[-1] if lines else "")
        try:
            return min(1.0, max(0.0, float(self._score(given, entry))))
        except Exception as exc:  # the verifier failing on a completion is the completion's fault: it scores 0
            if not self._warned:
                logger.debug("%s: the verifier failed on a completion (%s); scored 0", self.name, exc)
                self._warned = True
            return 0.0
