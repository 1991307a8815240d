"""Loading a run config: one TOML file, then ``RLBUS_*`` environment, then ``--set``.

Precedence (later wins): a worker's run descriptor, the config file (TOML, or the JSON that
``rlbus run`` hands its processes), environment variables ``RLBUS_<SECTION>__<KEY>`` (double
underscore between levels), then ``--set section.key=value``. Environment and ``--set`` values are
typed by the model, through pydantic-settings: a text field takes the value as it is
(``RLBUS_KAFKA__CLIENT_ID=2024`` is the text "2024"; a ``--set`` value in TOML quotes is the string
inside them), numbers and booleans are parsed, lists and
tables are JSON (``--set 'local.bench_worker_speeds=[1, 0.5]'``). A key of a table no model types
(``run.task_params``) takes a JSON or TOML value as written (``--set run.task_params.max_turns=8`` is
the number 8), other text as it is. A key that names no setting is an error that names it and lists
the settings there are.
"""

from __future__ import annotations

import json
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ValidationError
from pydantic._internal._utils import deep_update
from pydantic_settings import EnvSettingsSource

from consumers.stages import StageError
from rlbus.config.schema import ENV_PREFIX, ConfigError, RunConfig


def _unquoted(raw: str, origin: str) -> str:
    """A ``--set`` value written as a TOML string (``local.dir="runs/x"``, as in the file) is that
    string, without its quotes; one that opens a quote but is not one string is refused."""
    if raw[:1] not in ('"', "'"):
        return raw
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = None
    if not isinstance(value, str):
        item = origin.removeprefix("--set ")
        key = item.split("=", 1)[0].strip()
        raise ConfigError(f"--set {item!r}: a quoted value must be one TOML string: --set {key}=\"text\" or "
                          f"--set {key}=text")
    return value



class _Layer(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping: the same typing for the process
    environment and for ``--set``."""

    def __init__(self, mapping: dict[str, str]) -> None:
        self._mapping = {k.lower(): v for k, v in mapping.items()}
        super().__init__(
            RunConfig,  # type: ignore[arg-type]  # a plain model: only its fields are read
            case_sensitive=False, env_prefix=ENV_PREFIX, env_nested_delimiter="__", env_parse_none_str="null",
        )

    def _load_env_vars(self) -> dict[str, str | None]:
        return dict(self._mapping)

    def prepare_field_value(self, field_name: str, field: Any, value: Any, value_is_complex: bool) -> Any:
        if field_name == "store" and isinstance(value, str) and not value.lstrip().startswith("{"):
            return value  # a store URL: RunConfig turns it into a store config
        return super().prepare_field_value(field_name, field, value, value_is_complex)


def _unwrap(annotation: Any) -> list[Any]:
    """The types an annotation admits (Optional, unions and Annotated opened)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(annotation) for t in _unwrap(arg)]
    return [annotation]


def _resolve(parts: list[str], origin: str) -> tuple[list[str], bool]:
    """Check that ``parts`` names a setting; returns the path as the environment source splits it
    (the key of a dict setting, dots and all, is one part), and whether that is a key of a free-form
    table (``dict[str, Any]``, like ``run.task_params``), whose values no model types."""
    fields: dict[str, Any] = RunConfig.model_fields
    where: list[str] = []
    for i, part in enumerate(parts):
        if part not in fields:
            section = ".".join(where) or "the run config"
            raise ConfigError(f"{origin}: {section} has no setting {part!r}; its settings are: {', '.join(sorted(fields))}")
        where.append(part)
        kinds = _unwrap(fields[part].annotation)
        rest = parts[i + 1 :]
        if not rest:
            return where, False
        models = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]
        tables = [k for k in kinds if typing.get_origin(k) is dict or k is dict]
        if tables:
            free = any(k is dict or typing.get_args(k)[1:] in ((), (Any,)) for k in tables)
            return [*where, ".".join(rest)], free
        if not models:
            raise ConfigError(f"{origin}: {'.'.join(where)} is a single value, it has no {'.'.join(rest)!r}")
        fields = {name: f for model in models for name, f in model.model_fields.items()}
    return where, False


def _free_value(raw: str) -> Any:
    """A value for a key of a free-form table (``--set run.task_params.max_turns=8``), which no model
    types: JSON or a TOML value when it is one (``8``, ``0.5``, ``true``, ``[1, 2]``, ``{"a": 1}``,
    ``"text"``), else the text as written (``fast``)."""
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _overrides(items: list[tuple[str, str, str]]) -> dict[str, Any]:
    """Typed values of (dotted key, raw text, origin) overrides, as a nested dict. A ``--set`` value
    in TOML quotes is the text inside them."""
    mapping, free = {}, []
    for dotted, raw, origin in items:
        parts = dotted.split(".")
        if not all(parts):
            raise ConfigError(f"{origin}: {dotted!r} is not a dotted key like trainer.lr")
        path, untyped = _resolve(parts, origin)
        if untyped:
            free.append((path, _free_value(raw)))
        else:
            mapping[ENV_PREFIX + "__".join(path)] = _unquoted(raw, origin) if origin.startswith("--set") else raw
    try:
        typed = _Layer(mapping)()
    except ValueError as exc:  # pydantic-settings' SettingsError: a list or table that is not JSON
        raise ConfigError(f"{exc}; write lists and tables as JSON, e.g. [1, 0.5] or {{\"keep\": 4}}") from None
    for path, value in free:
        node = typed
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return typed


def _environment(environ: dict[str, str]) -> list[tuple[str, str, str]]:
    """The ``RLBUS_*`` variables that are settings: nested ones (``RLBUS_KAFKA__ACKS``) and whole
    sections given at once (``RLBUS_STORE``); others (``RLBUS_LOG_LEVEL``) are not config."""
    out = []
    for key, raw in sorted(environ.items()):
        name = key[len(ENV_PREFIX) :].lower()
        if key.upper().startswith(ENV_PREFIX) and ("__" in name or name in RunConfig.model_fields):
            out.append((".".join(name.split("__")), raw, f"environment variable {key}"))
    return out


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist (see configs/ for examples)") from None
    try:
        # JSON is what `rlbus run` hands its child processes (the resolved config).
        return json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        raise ConfigError(f"{path}: not valid {path.suffix[1:].upper() or 'TOML'}: {exc}") from None


def load_config(
    path: str | Path | None,
    overrides: list[str] | None = None,
    environ: dict[str, str] | None = None,
    base: dict[str, Any] | None = None,
) -> RunConfig:
    """``base`` (a worker's run descriptor) < the config file < ``RLBUS_*`` environment < ``--set``."""
    layers = [base or {}]
    if path is not None:
        layers.append(_read_file(Path(path)))
    layers.append(_overrides(_environment(dict(os.environ if environ is None else environ))))
    sets = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set trainer.lr=1e-4")
        dotted, raw = item.split("=", 1)
        sets.append((dotted.strip(), raw.strip(), f"--set {item}"))
    layers.append(_overrides(sets))
    data = deep_update(*layers)
    try:
        return RunConfig.model_validate(data)
    except StageError as exc:
        raise ConfigError(f"stages{' in ' + str(path) if path else ''}: {exc}") from None
    except ValidationError as exc:
        where = f" in {path}" if path else ""
        lines = [f"invalid configuration{where}:"]
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {loc}: {msg}" if loc else f"  {msg}")
        raise ConfigError("\n".join(lines)) from None
