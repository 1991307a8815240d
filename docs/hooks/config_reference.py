"""The configuration reference, rendered from the pydantic models at build time (so it cannot drift).

A page that holds the line ``<!-- config-reference -->`` gets, in its place, one table per section
of ``rlbus.config.RunConfig``: every field by its TOML path (``trainer.lr``), its type, default and
description (``Field(description=...)``); nested models as sections of their own, each variant of a
discriminated union (``type = "local" | "s3"``) as one, lists of tables as ``[[name]]``; then the
``params`` of each built-in data stage. Registered in ``docs/mkdocs.yml`` under ``hooks``. It
imports the config models only (no torch), as ``rlbus config schema`` does.
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


def _variant(model: type[BaseModel]) -> str | None:
    """The value of a model's ``type: Literal[...]`` selector, when it has one."""
    field = model.model_fields.get("type")
    if field is None or typing.get_origin(field.annotation) is not typing.Literal:
        return None
    return json.dumps(typing.get_args(field.annotation)[0])


def _type_name(annotation: Any) -> str:
    """A short, readable type: ``int``, ``str | None``, ``list[float]``, ``"a" | "b"``, ``table``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        tables = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        variants = [_variant(m) for m in tables]
        if len(tables) > 1 and all(variants):  # a discriminated union: one table, `type` picks its variant
            rest = [_type_name(a) for a in args if a not in tables]
            sep = " \\| "
            return sep.join([f"table (`type` = {sep.join(variants)})", *rest])
        return " \\| ".join(_type_name(a) for a in args)
    if origin in (list, tuple) and _models(annotation):
        return "array of tables"
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
        return "(its table)"
    if isinstance(value, enum.Enum):
        value = value.value
    try:
        text = json.dumps(value)
    except TypeError:
        text = str(value)
    return f"`{text}`" if len(text) <= 60 else "(see the model)"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _header(path: str, repeated: bool, model: type[BaseModel], variants: bool) -> str:
    header = f"[[{path}]]" if repeated else f"[{path}]"
    tag = _variant(model) if variants else None
    return f"### `{header}`" + (f" with `type = {tag}`" if tag else "") + "\n"


def _table(path: str, model: type[BaseModel], out: list[str], *, repeated: bool, variants: bool,
           about: str = "") -> None:
    """The section's table (every field by its TOML path), then its nested sections."""
    out.append(_header(path, repeated, model, variants))
    if about:
        out.append(about + "\n")
    doc = (model.__doc__ or "").strip().split("\n\n")[0]
    if doc:
        out.append(_cell(doc) + "\n")
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    nested: list[tuple[str, FieldInfo]] = []
    for name, field in model.model_fields.items():
        rows.append(f"| `{path}.{name}` | {_type_name(field.annotation)} | {_default(field)} | "
                    f"{_cell(field.description or '')} |")
        if _models(field.annotation):
            nested.append((name, field))
    out.append("\n".join(rows) + "\n")
    for name, field in nested:
        _section(f"{path}.{name}", field, out)


def _section(path: str, field: FieldInfo, out: list[str], *, about: str = "") -> None:
    """A field that holds one or more models: a table for each (each variant of a union)."""
    models = _models(field.annotation)
    for n, model in enumerate(models):
        _table(path, model, out, repeated=_is_list(field.annotation), variants=len(models) > 1,
               about=about if n == 0 else "")


def render() -> str:
    from consumers.stages.registry import GROUP_STAGES, PROMPT_STAGES
    from rlbus.config import RunConfig

    out: list[str] = ["## Sections\n"]
    for name, field in RunConfig.model_fields.items():
        if not _models(field.annotation):
            out.append(f"### `{name}`\n")
            out.append(f"{_type_name(field.annotation)}, default {_default(field)}. {_cell(field.description or '')}\n")
            continue
        # A top-level field's own description says what the section is when it is more than its
        # model's (`store`: a URL or a table); its type names the variants.
        about = ""
        if field.description:
            about = f"`{name}`: {_type_name(field.annotation)}, default {_default(field)}. {_cell(field.description)}"
        _section(name, field, out, about=about)
    out.append("## Built-in data stages\n")
    out.append("The `params` of each built-in stage a `[[trainer_stages]]` (group stages) or "
               "`[[curator_stages]]` (prompt stages) entry names by `type`; a stage of your own is "
               "named by its import path and validates its `params` with its own `Config`.\n")
    for kind, stages in (("trainer_stages", GROUP_STAGES), ("curator_stages", PROMPT_STAGES)):
        for stage_name, cls in sorted(stages.items()):
            out.append(f"### `[[{kind}]]` with `type = \"{stage_name}\"`\n")
            doc = (cls.__doc__ or "").strip().split("\n\n")[0]
            if doc:
                out.append(_cell(doc) + "\n")
            if not cls.Config.model_fields:
                out.append("No `params`.\n")
                continue
            rows = ["| key | type | default | description |", "|---|---|---|---|"]
            for name, field in cls.Config.model_fields.items():
                rows.append(f"| `{kind}.params.{name}` | {_type_name(field.annotation)} | {_default(field)} | "
                            f"{_cell(field.description or '')} |")
            out.append("\n".join(rows) + "\n")
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())
