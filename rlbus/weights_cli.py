"""`rlbus weights ls|show|verify`: read-only views of a weight store, printed for people."""

from __future__ import annotations

import json

import typer

from weightstore.config import build_store, store_config_from_url
from weightstore.errors import StoreError
from weightstore.inspect import list_policies, list_versions, show_version, verify_version
from weightstore.manifest import read_latest


def _store(url: str):
    return build_store(store_config_from_url(url))


def weights_ls(url: str, policy: str | None) -> None:
    store = _store(url)
    policies = [policy] if policy else list_policies(store)
    if not policies:
        typer.echo(f"no policies in {store.describe()}")
    for name in policies:
        typer.echo(f"policy {name}")
        typer.echo(f"  {'version':>7} {'kind':<6} {'base':>5} {'anchor':>6} {'bytes':>12} {'chunks':>6}")
        for row in list_versions(store, name):
            if "error" in row:
                typer.echo(f"  {row['version']:>7} ERROR {row['error']}")
                continue
            mark = "  <- LATEST" if row["latest"] else ""
            base = "-" if row["base_version"] is None else row["base_version"]
            typer.echo(
                f"  {row['version']:>7} {row['kind']:<6} {base:>5} {row['anchor_version']:>6} "
                f"{row['bytes']:>12} {row['chunks']:>6}{mark}"
            )


def weights_show(url: str, policy: str, version: int) -> None:
    typer.echo(show_version(_store(url), policy, version).model_dump_json(indent=1))


def weights_verify(url: str, policy: str, version: int | None, *, all_versions: bool = False) -> bool:
    """Print each checked version's result; True only if every one rebuilt with every hash right."""
    store = _store(url)
    if all_versions:
        if version is not None:
            typer.secho("give a version or --all, not both", fg="red", err=True)
            return False
        versions = [row["version"] for row in list_versions(store, policy)]
        if not versions:
            typer.secho(f"policy {policy!r} has no versions in {store.describe()}", fg="red", err=True)
            return False
    elif version is None:
        latest = read_latest(store, policy)
        if latest is None:
            typer.secho(f"policy {policy!r} has no LATEST in {store.describe()}", fg="red", err=True)
            return False
        versions = [latest[0].version]
    else:
        versions = [version]
    results = []
    for v in versions:
        try:
            result = verify_version(store, policy, v)
        except StoreError as exc:
            result = {"policy": policy, "version": v, "ok": False, "error": str(exc)}
        results.append(result)
        if not result["ok"]:
            typer.secho(f"v{v} FAILED: {result.get('error', 'unknown error')}", fg="red", err=True)
    typer.echo(json.dumps(results if all_versions else results[0], indent=1, default=str))
    return all(r["ok"] for r in results)
