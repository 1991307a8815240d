"""The configuration reference, rendered from the pydantic models at build time (so it cannot drift).

A page that holds the line ``<!-- config-reference -->`` gets, in its place, one table per section
of ``rlbus.config.RunConfig`` (nested models as sections of their own, the variants of a
discriminated union each as one, lists of tables as ``[[name]]``) and one per built-in data stage's
``params``. Registered in ``docs/mkdocs.yml`` under ``hooks``.
"""

from __future__ import annotations

import enum
import json
import types
import typing
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

MARKER = "<!-- config-reference -->"


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (itself, a union's members, a list's items)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in typing.get_args(annotation):
        found.extend(_models(arg))
    return found


def _is_list(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated):
        return any(_is_list(a) for a in typing.get_args(annotation))
    return origin in (list, tuple)


def _type_name(annotation: Any) -> str:
    """A short, readable type: ``int``, ``str | None``, ``list[float]``, ``"a" | "b"``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return "table"
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:
            return "(computed)"
    else:
        value = field.default
    if value is PydanticUndefined:
        return ""
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, BaseModel):
        return "(table below)"
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        text = json.dumps(value)
    except TypeError:
        text = str(value)
    return f"`{text}`" if len(text) <= 60 else "(see the model)"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table(path: str, model: type[BaseModel], out: list[str], *, repeated: bool, variant: str = "") -> None:
    """The section's table, then its nested sections."""
    header = f"[[{path}]]" if repeated else f"[{path}]"
    out.append(f"### `{header}`{variant}\n")
    doc = (model.__doc__ or "").strip().split("\n\n")[0]
    if doc:
        out.append(_cell(doc) + "\n")
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    nested: list[tuple[str, Any, FieldInfo]] = []
    for name, field in model.model_fields.items():
        rows.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | "
                    f"{_cell(field.description or '')} |")
        if _models(field.annotation):
            nested.append((name, field.annotation, field))
    out.append("\n".join(rows) + "\n")
    for name, annotation, _ in nested:
        sub = f"{path}.{name}" if path else name
        models = _models(annotation)
        for m in models:
            tag = ""
            type_field = m.model_fields.get("type")
            if len(models) > 1 and type_field is not None and typing.get_origin(type_field.annotation) is typing.Literal:
                tag = f" with `type = {json.dumps(typing.get_args(type_field.annotation)[0])}`"
            _table(sub, m, out, repeated=_is_list(annotation), variant=tag)


def render() -> str:
    from consumers.stages.registry import GROUP_STAGES, PROMPT_STAGES
    from rlbus.config import RunConfig

    out: list[str] = ["## Sections\n"]
    for name, field in RunConfig.model_fields.items():
        models = _models(field.annotation)
        if not models:
            out.append(f"### `{name}`\n")
            out.append(f"{_type_name(field.annotation)}, default {_default(field)}. {_cell(field.description or '')}\n")
            continue
        for m in models:
            tag = ""
            type_field = m.model_fields.get("type")
            if len(models) > 1 and type_field is not None and typing.get_origin(type_field.annotation) is typing.Literal:
                tag = f" with `type = {json.dumps(typing.get_args(type_field.annotation)[0])}`"
            _table(name, m, out, repeated=_is_list(field.annotation), variant=tag)
    out.append("## Built-in data stages\n")
    out.append("The `params` of each built-in stage a `[[trainer_stages]]` (group stages) or "
               "`[[curator_stages]]` (prompt stages) entry names by `type`.\n")
    for kind, stages in (("trainer_stages", GROUP_STAGES), ("curator_stages", PROMPT_STAGES)):
        for stage_name, cls in sorted(stages.items()):
            _table(f"{kind}", cls.Config, out, repeated=True, variant=f" with `type = \"{stage_name}\"`")
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
