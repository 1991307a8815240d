"""The composed run configuration: its schema (``schema``: the models, the worker's run
descriptor, the secrets) and how it is loaded (``loader``: one TOML file, then ``RLBUS_*``
environment, then ``--set``).

This package imports no torch: ``rlbus --help`` and config validation stay fast.
"""

from __future__ import annotations

from rlbus.config.loader import load_config
from rlbus.config.schema import (
    WORKER_SECTIONS,
    ConfigError,
    LocalRegion,
    RunConfig,
    secret_environment,
    without_secrets,
    worker_descriptor,
)

__all__ = [
    "WORKER_SECTIONS",
    "ConfigError",
    "LocalRegion",
    "RunConfig",
    "load_config",
    "secret_environment",
    "without_secrets",
    "worker_descriptor",
]
