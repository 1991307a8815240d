"""Command-line options that every benchmark takes the same way."""

from __future__ import annotations

from typing import Annotated

import typer

JsonOption = Annotated[bool, typer.Option("--json", help="Print the figures as one JSON object, and nothing else.")]
"""``--json``: the benchmark's figures as one JSON object on standard output (progress goes to standard error)."""
