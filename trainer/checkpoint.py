"""Trainer checkpoints: weights, optimizer state, version and the Kafka offsets trained on.

Layout under the checkpoint root::

    v00000042/state/        the policy and its optimizer (and the value model and its optimizer,
                            when the trainer has one), as a torch.distributed.checkpoint (DCP):
                            each rank writes its own shards, and a checkpoint loads on any number
                            of ranks (DCP reshards on load); names are the model's own parameter names
    v00000042/meta.json     {"version", "offsets": {topic: {partition: offset}}, "extra"}

The offsets are the next ones to read, of every topic the trainer read: its policy's trajectory topic
and the regions' mirrors of it (``<region>.<run>.trajectories.<policy>``); a checkpoint of a trainer
that read its own topic only holds that one, and resumes the same way.

A checkpoint is written into a hidden staging directory (every rank writes its part there) and
renamed into place by rank 0, so a reader sees either nothing or a complete checkpoint. Only the
newest ``keep`` are kept.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

PREFIX = "v"
STATE = "state"


class CheckpointFormatError(ValueError):
    """A checkpoint directory this version cannot restore; the message says what to do."""

    retriable = False


@dataclass
class Checkpoint:
    path: Path
    version: int
    offsets: dict[str, dict[int, int]]
    extra: dict[str, Any] = field(default_factory=dict)

    def partition_offsets(self, keep: Callable[[str], bool]) -> dict[tuple[str, int], int]:
        """The offsets of the topics ``keep`` accepts, per (topic, partition)."""
        return {(t, p): o for t, parts in self.offsets.items() if keep(t) for p, o in parts.items()}

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load the saved weights (and optimizer state) into ``model`` (and ``optimizer``), whatever
        their sharding (a collective: every rank calls it)."""
        _load(self.path, "policy", model, optimizer)

    def restore_value(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """Load the saved value model and its optimizer; False when the checkpoint has none."""
        if not self.has_value:
            return False
        _load(self.path, "value", model, optimizer)
        return True

    @property
    def has_value(self) -> bool:
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(str(self.path / STATE)).read_metadata().state_dict_metadata
        return any(k.startswith("value.") for k in keys)


def offsets_by_topic(offsets: Mapping[tuple[str, int], int]) -> dict[str, dict[int, int]]:
    """Offsets per (topic, partition) as a checkpoint keeps them, ``{topic: {partition: offset}}``."""
    out: dict[str, dict[int, int]] = {}
    for (topic, partition), offset in sorted(offsets.items()):
        out.setdefault(topic, {})[partition] = offset
    return out


def _states(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    weights, optim = get_state_dict(model, optimizer)
    return {"model": weights, "optim": optim}


def _load(path: Path, part: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = {part: _states(model, optimizer)}
    dcp.load(state, checkpoint_id=str(path / STATE))
    loaded = state[part]
    if optimizer is None:
        set_model_state_dict(model, loaded["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])


def staging_dir(root: Path, version: int) -> Path:
    """A new hidden directory under ``root`` that checkpoint ``version`` is written into (rank 0
    makes it and tells the other ranks)."""
    if version < 0:
        raise ValueError(f"need version >= 0, got {version}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{version:08d}"
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists; versions are written once")
    return Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))


def write_states(staging: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 value: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None) -> None:
    """This rank's shards of the policy (and of the value model) into ``staging`` (a collective)."""
    import torch.distributed.checkpoint as dcp

    state = {"policy": _states(model, optimizer)}
    if value is not None:
        state["value"] = _states(*value)
    dcp.save(state, checkpoint_id=str(Path(staging) / STATE))


def commit_checkpoint(root: Path, staging: Path, *, version: int, offsets: dict[str, dict[int, int]],
                      extra: dict[str, Any] | None = None, keep: int = 2) -> Path:
    """Rank 0, once every rank wrote its shards: the metadata, then ``staging`` renamed into place as
    checkpoint ``version``; all but the newest ``keep`` deleted."""
    if keep < 1:
        raise ValueError(f"need keep >= 1, got {keep}")
    root, staging = Path(root), Path(staging)
    final = root / f"{PREFIX}{version:08d}"
    try:
        meta = {
            "version": version,
            "offsets": {topic: {str(p): int(o) for p, o in parts.items()} for topic, parts in offsets.items()},
            "extra": extra or {},
        }
        (staging / "meta.json").write_text(json.dumps(meta, indent=1))
        for name in ("meta.json", f"{STATE}/.metadata"):
            with open(staging / name, "rb") as f:
                os.fsync(f.fileno())
        os.rename(staging, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for old in _versions(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    logger.info("saved checkpoint %s", final)
    return final


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
    """Write checkpoint ``version`` of a one-process trainer atomically under ``root`` (with ``value``:
    the value model and its optimizer); delete all but the newest ``keep``."""
    staging = staging_dir(root, version)
    try:
        write_states(staging, model=model, optimizer=optimizer, value=value)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return commit_checkpoint(root, staging, version=version, offsets=offsets, extra=extra, keep=keep)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _versions(root: Path) -> list[Path]:
    """Complete checkpoint directories under ``root``, oldest first."""
    found = []
    for p in root.iterdir() if root.is_dir() else ():
        if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit():
            found.append((int(p.name[len(PREFIX):]), p))
    return [p for _, p in sorted(found)]


def kept_offsets(root: Path) -> dict[tuple[str, int], int] | None:
    """The lowest offset of every (topic, partition) over the checkpoints kept under ``root``: below it
    no resume reads (``broker.retention`` trims the trajectory log there); None when there is none."""
    from broker.retention import TrimFailed

    floors: dict[tuple[str, int], int] = {}
    versions = _versions(Path(root))
    for path in versions:
        try:
            offsets = _read(path).partition_offsets(lambda _topic: True)
        except (OSError, ValueError, KeyError) as exc:  # being removed, or damaged: hold everything this round
            raise TrimFailed(f"checkpoint {path} unreadable ({exc})") from None
        for key, offset in offsets.items():
            floors[key] = min(floors.get(key, offset), offset)
    return floors if versions else None


def _read(path: Path) -> Checkpoint:
    """The checkpoint in directory ``path``, from its meta.json (its state is read by ``restore``)."""
    meta = json.loads((path / "meta.json").read_text())
    offsets = {t: {int(p): int(o) for p, o in parts.items()} for t, parts in meta["offsets"].items()}
    return Checkpoint(path=path, version=int(meta["version"]), offsets=offsets, extra=meta.get("extra", {}))


def load_latest_checkpoint(root: Path) -> Checkpoint | None:
    """The newest complete checkpoint under ``root`` (its metadata; ``restore`` loads the state), or
    None when there is none."""
    versions = _versions(Path(root))
    if not versions:
        return None
    path = versions[-1]
    if not (path / STATE / ".metadata").is_file():
        raise CheckpointFormatError(
            f"checkpoint {path} has no {STATE}/.metadata: it was written by an earlier rlbus (model.safetensors and "
            "optimizer.pt) or is damaged. Resume it with the rlbus that wrote it, or move it away to start from the "
            "one before it or from the base model")
    return _read(path)
