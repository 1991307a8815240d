"""``tool``: multi-turn episodes where the model calls tools and answers from what they return.

The format the model is prompted and rewarded for (one call per turn)::

    <tool_call>{"name": "calculator", "arguments": {"expression": "12*(3+4)"}}</tool_call>
    <tool_response>84</tool_response>          (appended by the environment, masked out of the loss)
    ...
    <answer>84</answer>

Tools: ``calculator`` (arithmetic on numbers: + - * / // % ** and parentheses, evaluated from the
syntax tree, never with ``eval``; exponents and results are bounded) and ``search`` (BM25 with
``bm25s`` over a local corpus: a JSONL file of ``{"id", "text"}`` documents, ``corpus`` param;
it returns the ``top_k`` best documents). A turn ends after its first ``</tool_call>``; an
episode ends at a turn without a call, at ``<answer>``, or after ``max_turns`` turns. A malformed
call or a failing tool is answered with an error message, as a real tool would be; it never ends
the episode. Reward: 1 when the last ``<answer>`` equals the reference (numbers compared as
numbers, text case- and space-insensitively), else 0.
"""

from __future__ import annotations

import ast
import json
import operator
import threading
from pathlib import Path

from producers.episodes import Observation
from producers.tasks.calls import ANSWER, answer_score

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e18

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class ToolError(ValueError):
    """A call the tool cannot serve; its message is what the model reads back."""


def calculate(expression: str) -> float | int:
    """The value of an arithmetic expression, from its syntax tree (no names, calls or attributes)."""
    if len(expression) > 200:
        raise ToolError("expression too long (200 characters at most)")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ToolError(f"cannot parse {expression!r}") from None

    def value(node: ast.AST) -> float | int:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ToolError(f"exponent {right} too large")
            try:
                result = _BINARY[type(node.op)](left, right)
            except (ZeroDivisionError, OverflowError) as exc:
                raise ToolError(str(exc)) from None
            if isinstance(result, complex) or abs(result) > MAX_MAGNITUDE:
                raise ToolError("result out of range")
            return result
        raise ToolError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")

    return value(tree)


class Corpus:
    """BM25 search over a JSONL file of ``{"id", "text"}`` documents (or over texts, ``Corpus.of``)."""

    def __init__(self, path: str | Path | None, top_k: int, docs: list[str] | None = None) -> None:
        import bm25s

        self.docs: list[str] = list(docs or [])
        for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines() if path else [], start=1):
            if line.strip():
                doc = json.loads(line)
                if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                    raise ValueError(f"corpus {path}:{n}: expected {{'id', 'text'}} with a string text")
                self.docs.append(doc["text"])
        if not self.docs:
            raise ValueError(f"corpus {path or '(given documents)'} holds no documents")
        self.top_k = min(top_k, len(self.docs))
        self._bm25s = bm25s
        self._index = bm25s.BM25()
        self._index.index(bm25s.tokenize(self.docs, stopwords="en", show_progress=False), show_progress=False)
        self._lock = threading.Lock()

    @classmethod
    def of(cls, docs: list[str], top_k: int) -> Corpus:
        """BM25 search over ``docs`` (texts) instead of a file."""
        return cls(None, top_k, docs)

    def search(self, query: str) -> str:
        tokens = self._bm25s.tokenize([query], stopwords="en", show_progress=False)
        with self._lock:
            found, scores = self._index.retrieve(tokens, k=self.top_k, show_progress=False)
        hits = [self.docs[int(i)] for i, s in zip(found[0], scores[0]) if s > 0]
        return "\n".join(f"[{n + 1}] {text}" for n, text in enumerate(hits)) or "no results"


class ToolTask:
    """Multi-turn tool use: calculator and corpus search, answer in ``<answer>`` tags."""

    name = "tool"

    def __init__(self, *, corpus: str | None = None, max_turns: int = 4, top_k: int = 2,
                 max_observation_chars: int = 500) -> None:
        if max_turns < 1 or top_k < 1 or max_observation_chars < 1:
            raise ValueError("max_turns, top_k and max_observation_chars must be at least 1")
        self.max_turns, self.max_observation_chars = max_turns, max_observation_chars
        self.corpus = Corpus(corpus, top_k) if corpus is not None else None

    def observe(self, prompt: str, turn: str, answer: str) -> Observation | None:
        end = turn.find(CALL_CLOSE)
        if end < 0 or ANSWER.search(turn[:end]):
            return None  # no call this turn, or the model answered first: the episode ends
        start = turn.rfind(CALL_OPEN, 0, end)
        call = turn[start + len(CALL_OPEN):end] if start >= 0 else turn[:end]
        try:
            result = self._call(call)
        except ToolError as exc:
            result = f"error: {exc}"
        text = result[: self.max_observation_chars]
        return Observation(consumed=end + len(CALL_CLOSE), text=f"\n<tool_response>{text}</tool_response>\n")

    def _call(self, call: str) -> str:
        try:
            request = json.loads(call)
        except json.JSONDecodeError:
            raise ToolError('a call is JSON: {"name": ..., "arguments": {...}}') from None
        if not isinstance(request, dict) or not isinstance(request.get("arguments", {}), dict):
            raise ToolError('a call is JSON: {"name": ..., "arguments": {...}}')
        name, args = request.get("name"), request.get("arguments", {})
        if name == "calculator":
            return _number(calculate(str(args.get("expression", ""))))
        if name == "search" and self.corpus is not None:
            return self.corpus.search(str(args.get("query", "")))
        tools = ["calculator"] + (["search"] if self.corpus is not None else [])
        raise ToolError(f"unknown tool {name!r}; tools: {', '.join(tools)}")

    def score(self, prompt: str, completion: str, answer: str) -> float:
        return answer_score(completion, answer)


def _number(x: float | int) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)
