"""``math``: the final answer of a completion, checked for equivalence with the reference by math-verify.

Extraction, in order: the last ``\\boxed{...}`` (or ``\\fbox{...}``, braces balanced), else the
text after the last ``####`` (GSM8K), else the last number in the text (``-3.5``, ``3/4``,
``1,234``). The extracted text and the reference (``"42"``, ``"0.5"``, ``"\\frac{1}{2}"``, any
LaTeX expression) are parsed by math-verify and compared with its ``verify``; when math-verify
cannot parse one of them, they are compared as normalised strings (spaces, ``$`` and a trailing
``.`` removed). A line ``{"prompt": ..., "answer": ...}`` is all a dataset needs.

math-verify bounds its own work with ``SIGALRM``, which only the main thread may use: there it
gets ``timeout_s``; in other threads it gets none, and the extracted answer is capped at
``max_answer_chars`` instead (completions at ``max_completion_chars``, from the end).
"""

from __future__ import annotations

import logging
import re
import threading

logger = logging.getLogger(__name__)

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    found = None
    for match in _BOX.finditer(text):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found = text[start:i]
                break
    return found


def extract_answer(text: str) -> str | None:
    """The completion's final answer: last ``\\boxed{}``, else after the last ``####``, else the last number."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        if tail:
            return tail.splitlines()[0].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(" ", "") if numbers else None


def _normalise(text: str) -> str:
    return text.replace(" ", "").replace("$", "").replace(",", "").rstrip(".").lower()


class MathTask:
    """Reward 1 when the completion's final answer equals the reference mathematically, else 0."""

    name = "math"

    def __init__(self, *, timeout_s: int = 5, max_completion_chars: int = 20_000, max_answer_chars: int = 300,
                 format_reward: float = 0.0) -> None:
        if timeout_s < 1 or max_completion_chars < 1 or max_answer_chars < 1:
            raise ValueError("timeout_s, max_completion_chars and max_answer_chars must be at least 1")
        if not 0.0 <= format_reward < 1.0:
            raise ValueError(f"format_reward {format_reward} must be in [0, 1)")
        self.timeout_s, self.max_completion_chars = timeout_s, max_completion_chars
        self.max_answer_chars, self.format_reward = max_answer_chars, format_reward

    def demonstration(self, answer: str) -> str:
        """What a correct completion looks like, for a supervised warm-up."""
        return f"\\boxed{{{answer}}}"

    def score(self, prompt: str, completion: str, answer: str) -> float:
        given = extract_answer(completion[-self.max_completion_chars:])
        if given is None:
            return 0.0
        if self.equivalent(given[: self.max_answer_chars], answer):
            return 1.0
        return self.format_reward

    def equivalent(self, given: str, reference: str) -> bool:
        """math-verify's equivalence of two answers, or equal normalised strings where it cannot parse."""
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

        timeout = self.timeout_s if threading.current_thread() is threading.main_thread() else None
        targets = [LatexExtractionConfig(), ExprExtractionConfig()]
        try:
            gold = parse(f"${reference}$", extraction_config=targets, parsing_timeout=timeout)
            pred = parse(f"${given}$", extraction_config=targets, parsing_timeout=timeout)
            if gold and pred:
                return bool(verify(gold, pred, timeout_seconds=timeout))
        except Exception as exc:  # math-verify raises its own timeouts and sympy errors: the answer is unusable
            logger.debug("math-verify could not compare %r with %r: %s", given[:80], reference[:80], exc)
        return _normalise(given) == _normalise(reference)
