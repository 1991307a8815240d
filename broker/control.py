"""Encoding of control records (small JSON documents on ``<run>.control``)."""

from __future__ import annotations

import json

from pydantic import ValidationError

from broker.errors import RecordError
from broker.schema import ControlRecord

CONTROL_PARTITIONS = 1
"""One partition keeps announcements in order for every reader."""


def encode_control(record: ControlRecord) -> bytes:
    return record.model_dump_json().encode()


def decode_control(data: bytes) -> ControlRecord:
    try:
        return ControlRecord.model_validate(json.loads(data))
    except (ValueError, ValidationError) as exc:
        raise RecordError(f"malformed control record: {exc}") from exc
