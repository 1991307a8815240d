"""Prompt records to token ids: plain text as it is, chat turns through the checkpoint's chat template.

The tokenizer is the policy's own (``AutoTokenizer`` from the checkpoint directory), so a chat
prompt is rendered exactly as the checkpoint was trained to read it, generation prompt included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class PromptError(ValueError):
    """A prompt this policy's tokenizer cannot render; the message says what to change."""

    retriable = False

    @property
    def reason(self) -> str:
        return str(self)


def prompt_token_ids(tokenizer: Any, prompt: str, messages: Sequence[Mapping[str, str] | Any] | None) -> list[int]:
    """Token ids of one prompt: ``prompt`` tokenized as it is when ``messages`` is None, else the
    chat turns rendered with the tokenizer's chat template and its generation prompt."""
    if messages is None:
        return list(tokenizer(prompt)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError(
            "a chat prompt (messages) for a checkpoint whose tokenizer has no chat template: use a chat "
            "checkpoint, give it one (tokenizer_config.json chat_template), or send plain prompts "
            "(data.fields.chat = false and no messages field)"
        )
    turns = [dict(m) if isinstance(m, Mapping) else m.model_dump() for m in messages]
    try:
        rendered = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=True)
    except Exception as exc:  # a template may raise anything (jinja2 errors, its own raise_exception)
        raise PromptError(f"the checkpoint's chat template cannot render these turns: {exc}") from None
    return list(rendered["input_ids"])
