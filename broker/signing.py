"""The fleet's signing key: workers sign every trajectory group with it (HMAC-SHA256, see
``broker.codec``), the trainer intake checks the signatures (and, with
``intake.require_signature``, sends unsigned groups to the DLQ)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


class SigningConfig(BaseModel):
    """Where the HMAC key shared by the fleet and the trainer comes from (at most one source)."""

    model_config = ConfigDict(extra="forbid")

    key: SecretStr | None = Field(
        default=None, description="The key itself (never logged); prefer RLBUS_SIGNING__KEY or key_file."
    )
    key_file: str | None = Field(
        default=None,
        description="File holding the key: its bytes, one trailing newline dropped (e.g. a mounted secret).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> SigningConfig:
        if self.key is not None and self.key_file is not None:
            raise ValueError("set signing.key or signing.key_file, not both")
        if self.key is not None and not self.key.get_secret_value():
            raise ValueError("signing.key is empty")
        if self.key_file is not None and not Path(self.key_file).is_file():
            raise ValueError(f"signing.key_file {self.key_file!r} does not exist or is not a file")
        return self

    @property
    def configured(self) -> bool:
        return self.key is not None or self.key_file is not None

    def load_key(self) -> bytes | None:
        """The key's bytes, or None when no key is configured."""
        if self.key is not None:
            return self.key.get_secret_value().encode()
        if self.key_file is not None:
            data = Path(self.key_file).read_bytes()
            data = data[:-1] if data.endswith(b"\n") else data
            if not data:
                raise ValueError(f"signing.key_file {self.key_file!r} is empty")
            return data
        return None
