"""Trainer checkpoints: weights, optimizer state, version and the Kafka offsets trained on.

Layout under the checkpoint root::

    v00000042/model.safetensors   model state (safetensors; tied weights stored once)
    v00000042/optimizer.pt        optimizer state_dict (tensors and plain containers only, so it
                                  loads with ``torch.load(weights_only=True)``)
    v00000042/meta.json           {"version", "offsets": {topic: {partition: offset}}, "extra"}
    v00000042/value.safetensors   the value model, when the trainer has one (VAPO), and
    v00000042/value_optimizer.pt  its optimizer state

A checkpoint is written into a hidden temporary directory and renamed into place, so a reader
sees either nothing or a complete checkpoint. Only the newest ``keep`` are kept.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_model

logger = logging.getLogger(__name__)

PREFIX = "v"


@dataclass
class Checkpoint:
    path: Path
    version: int
    offsets: dict[str, dict[int, int]]
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    value_state: dict[str, torch.Tensor] | None = None
    value_optimizer_state: dict[str, Any] | None = None

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load the saved weights (and optimizer state) into ``model`` (and ``optimizer``)."""
        _load_into(model, self.model_state, self.path)
        if optimizer is not None:
            optimizer.load_state_dict(self.optimizer_state)

    def restore_value(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """Load the saved value model and its optimizer; False when the checkpoint has none."""
        if self.value_state is None:
            return False
        _load_into(model, self.value_state, self.path)
        optimizer.load_state_dict(self.value_optimizer_state)
        return True


def _load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    aliases = _storage_groups(model)
    missing = [k for k in missing if not any(a in state for a in aliases[k])]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit the model: missing {missing}, unexpected {unexpected}")


def _storage_groups(model: torch.nn.Module) -> dict[str, list[str]]:
    """For each state name, every name sharing its storage (tied weights are saved once)."""
    by_ptr: dict[int, list[str]] = {}
    state = model.state_dict()
    for name, tensor in state.items():
        by_ptr.setdefault(tensor.data_ptr(), []).append(name)
    return {name: by_ptr[tensor.data_ptr()] for name, tensor in state.items()}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    root: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    version: int,
    offsets: dict[str, dict[int, int]],
    extra: dict[str, Any] | None = None,
    keep: int = 2,
    value: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None,
) -> Path:
    """Write checkpoint ``version`` atomically under ``root`` (with ``value``: the value model and its
    optimizer); delete all but the newest ``keep``."""
    if version < 0 or keep < 1:
        raise ValueError(f"need version >= 0 and keep >= 1, got version={version}, keep={keep}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{version:08d}"
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists; versions are written once")
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
    try:
        save_model(model, str(tmp / "model.safetensors"))
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        meta = {
            "version": version,
            "offsets": {topic: {str(p): int(o) for p, o in parts.items()} for topic, parts in offsets.items()},
            "extra": extra or {},
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        names = ["model.safetensors", "optimizer.pt", "meta.json"]
        if value is not None:
            save_model(value[0], str(tmp / "value.safetensors"))
            torch.save(value[1].state_dict(), tmp / "value_optimizer.pt")
            names += ["value.safetensors", "value_optimizer.pt"]
        for name in names:
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in _versions(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    logger.info("saved checkpoint %s", final)
    return final


def _versions(root: Path) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest first."""
    found = []
    for p in root.iterdir() if root.is_dir() else ():
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit():
            found.append((int(p.name[len(PREFIX):]), p))
    return [p for _, p in sorted(found)]


def load_latest_checkpoint(root: Path) -> Checkpoint | None:
    """The newest complete checkpoint under ``root``, or None when there is none."""
    versions = _versions(Path(root))
    if not versions:
        return None
    path = versions[-1]
    meta = json.loads((path / "meta.json").read_text())
    offsets = {t: {int(p): int(o) for p, o in parts.items()} for t, parts in meta["offsets"].items()}
    return Checkpoint(
        path=path,
        version=int(meta["version"]),
        offsets=offsets,
        model_state=load_file(str(path / "model.safetensors")),
        optimizer_state=torch.load(path / "optimizer.pt", weights_only=True),
        extra=meta.get("extra", {}),
        value_state=load_file(str(path / "value.safetensors")) if (path / "value.safetensors").is_file() else None,
        value_optimizer_state=(torch.load(path / "value_optimizer.pt", weights_only=True)
                               if (path / "value_optimizer.pt").is_file() else None),
    )
