"""``math``: the final answer of a completion, checked for equivalence with the reference by math-verify.

Extraction, in order: the last ``\\boxed{...}`` (or ``\\fbox{...}``, braces balanced), else the
text after the last ``####`` (GSM8K), else the last number in the text (``-3.5``, ``3/4``,
``1,234``). The extracted text and the reference (``"42"``, ``"0.5"``, ``"\\frac{1}{2}"``, any
LaTeX expression) match when they are equal as normalised strings (spaces, ``$``, commas and a
trailing ``.`` removed, lower case; the fallback where math-verify cannot parse one of them), or
else when math-verify parses both and its ``verify`` finds them equivalent in time. A line
``{"prompt": ..., "answer": ...}`` is all a dataset needs.

Bounding math-verify: its own timeouts use ``SIGALRM``, which only a main thread may set (``parse``
and ``verify`` raise in a worker thread unless given ``parsing_timeout=None``/``timeout_seconds=None``),
and an alarm is handled between bytecodes, so it cannot stop ``\\boxed{10^{10^{10}}}``, where sympy
computes a huge integer in one C call holding the GIL. So math-verify runs in worker processes
(``producers.tasks.bounded``), in their main thread, where its alarms work: each of its three steps
(parse the reference, parse the answer, verify) gets ``timeout_s // 3`` seconds, and a worker that
has not answered in ``timeout_s`` is killed. The extracted answer is cut to ``max_answer_chars``
and the completion to its last ``max_completion_chars`` before extraction.
"""

from __future__ import annotations

import logging
import re

from producers.tasks import AnswerError
from producers.tasks.bounded import BoundedCallError, BoundedPool

logger = logging.getLogger(__name__)

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{`` whose brace closes; one pass over the text."""
    closing: dict[int, int] = {}
    opened: list[int] = []
    for i, char in enumerate(text):
        if char == "{":
            opened.append(i)
        elif char == "}" and opened:
            closing[opened.pop()] = i
    for match in reversed(list(_BOX.finditer(text))):
        end = closing.get(match.end() - 1)
        if end is not None:
            return text[match.end():end]
    return None


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


def _warm_math_verify() -> None:
    """Import math-verify and sympy in a worker before its first comparison; its timeouts on a
    model's answer are expected (the answer scores 0), not warnings."""
    from math_verify import parse

    logging.getLogger("math_verify").setLevel(logging.ERROR)
    parse("$1$")


def _math_verify_equal(given: str, reference: str, step_timeout_s: int) -> bool:
    """In a worker's main thread: math-verify's verdict (False when it cannot parse one of the two)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    targets = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = parse(f"${reference}$", extraction_config=targets, parsing_timeout=step_timeout_s)
    pred = parse(f"${given}$", extraction_config=targets, parsing_timeout=step_timeout_s)
    return bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=step_timeout_s))


class MathTask:
    """Reward 1 when the completion's final answer equals the reference mathematically, else 0
    (``format_reward`` for a wrong answer that could at least be extracted)."""

    name = "math"

    def __init__(self, *, timeout_s: int = 6, max_completion_chars: int = 20_000, max_answer_chars: int = 300,
                 format_reward: float = 0.0) -> None:
        if timeout_s < 3:
            raise ValueError(f"timeout_s {timeout_s} must be at least 3 (a third of it bounds each math-verify step)")
        if max_completion_chars < 1 or max_answer_chars < 1:
            raise ValueError("max_completion_chars and max_answer_chars must be at least 1")
        if not 0.0 <= format_reward < 1.0:
            raise ValueError(f"format_reward {format_reward} must be in [0, 1)")
        self.timeout_s, self.max_completion_chars = timeout_s, max_completion_chars
        self.max_answer_chars, self.format_reward = max_answer_chars, format_reward
        self._pool = BoundedPool(timeout_s=timeout_s, warmup=_warm_math_verify)

    def demonstration(self, answer: str) -> str:
        """What a correct completion looks like, for a supervised warm-up."""
        return f"\\boxed{{{answer}}}"

    def score(self, prompt: str, completion: str, answer: str) -> float:
        if not answer.strip():
            raise AnswerError("math: the reference answer is empty; give each line an 'answer' (e.g. \"42\")")
        given = extract_answer(completion[-self.max_completion_chars:])
        if given is None:
            return 0.0
        if self.equivalent(given[: self.max_answer_chars], answer.strip()):
            return 1.0
        return self.format_reward

    def equivalent(self, given: str, reference: str) -> bool:
        """Equal as normalised strings (checked first: ``1,234`` is a tuple to math-verify), or
        equivalent for math-verify."""
        if _normalise(given) == _normalise(reference):
            return True
        try:
            return self._pool.call(_math_verify_equal, given, reference, self.timeout_s // 3)
        except BoundedCallError as exc:  # math-verify failed or ran out of time on this answer: not shown equal
            logger.debug("math-verify could not compare %r with %r: %s", given[:80], reference[:80], exc)
            return False

    def close(self) -> None:
        """Stop the math-verify worker processes (they also end with this process)."""
        self._pool.close()
