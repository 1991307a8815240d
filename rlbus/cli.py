"""The ``rlbus`` command line. Thin: parse and validate first, import the heavy parts after.

``rlbus --help`` imports neither torch nor Kafka clients.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, help="rlbus: RL training of LLMs over Kafka and S3.")
weights_app = typer.Typer(no_args_is_help=True, help="Inspect the weights in a store.")
config_app = typer.Typer(no_args_is_help=True, help="Show the resolved run config, or its JSON schema.")
app.add_typer(weights_app, name="weights")
app.add_typer(config_app, name="config")

ConfigArg = Annotated[Optional[Path], typer.Option("--config", "-c", help="Run config TOML.")]
SetOpt = Annotated[Optional[list[str]], typer.Option("--set", help="Dotted override KEY=VALUE (repeatable).")]
BrokerOpt = Annotated[Optional[str], typer.Option("--broker", help="Kafka bootstrap HOST:PORT.")]
StoreOpt = Annotated[Optional[str], typer.Option("--store", help="Store URL: s3://bucket/prefix or a path.")]
MetricsPortOpt = Annotated[Optional[int], typer.Option(
    "--metrics-port", help="Serve this process's metrics for Prometheus on this port (/metrics); also "
    "RLBUS_METRICS_PORT. OTLP export follows the OTEL_* variables.")]


def _overrides(sets: list[str] | None, broker: str | None = None, store: str | None = None) -> list[str]:
    overrides = list(sets or [])
    if broker:
        overrides.append(f"kafka.bootstrap_servers={broker}")
    if store:
        overrides.append(f"store={store}")
    return overrides


def _load(config: Path | None, sets: list[str] | None, broker: str | None = None, store: str | None = None):
    from rlbus.config import ConfigError, load_config

    try:
        return load_config(config, _overrides(sets, broker, store))
    except ConfigError as exc:
        _fail(str(exc), code=2)


def _fail(message: str, code: int = 1) -> None:
    typer.secho(message, fg="red", err=True)
    raise typer.Exit(code)


def _input_errors() -> tuple[type[Exception], ...]:
    """Errors that mean the user's input (config, task, checkpoint, data) cannot be used: reported
    as one message and exit code 2, never as a traceback."""
    from broker.errors import BrokerNotConfigured
    from consumers.dataset import DatasetError
    from producers.tasks import AnswerError, TaskError
    from producers.workflows import WorkflowError
    from rlbus.config import ConfigError
    from trainer.model import CheckpointError

    return BrokerNotConfigured, ConfigError, TaskError, AnswerError, DatasetError, CheckpointError, WorkflowError


def _role(name: str, call, metrics_port: int | None = None) -> None:
    """Configure logging (and metrics on ``metrics_port``) for role ``name``, run it, exit with its
    code; bad input (config, task, checkpoint, data, a missing broker address) is reported as a
    configuration error."""
    from rlbus.logs import configure_logging

    try:
        configure_logging(name, metrics_port=metrics_port)
        code = call()
    except Exception as exc:
        # the tuple is built only on an error: it imports torch, seconds a role that ends well
        # (a link, a replicator) would otherwise spend at its exit
        if isinstance(exc, _input_errors()):
            _fail(str(exc), code=2)
        raise
    sys.exit(code)


@app.command()
def run(
    config: Annotated[Optional[Path], typer.Argument(help="Run config TOML (default: built-in defaults).")] = None,
    sets: SetOpt = None,
    store: StoreOpt = None,
    resume: Annotated[Optional[Path], typer.Option(
        help="Continue the stopped or crashed run in this directory (its config.json; --set still applies).")] = None,
    plain: Annotated[bool, typer.Option(
        "--plain", help="One line per trainer step instead of the live panel (the default when stdout is not "
        "a terminal), for logs and CI.")] = False,
) -> None:
    """Run everything locally: embedded broker, store, curator, trainer and N workers.

    Exit status: 0 the run finished; 3 its wall budget (local.max_wall_s) stopped it, its newest version
    scored and summary and report written; 2 bad input; 1 it failed."""
    if resume is not None:
        if config is not None:
            _fail("give a config or --resume RUN_DIR, not both: a resumed run keeps its own config", code=2)
        if not (resume / "config.json").is_file():
            _fail(f"{resume} is not a run directory (no config.json): give the directory `rlbus run` printed", code=2)
        config = resume / "config.json"
    cfg = _load(config, sets, store=store)
    from rlbus import roles
    from rlbus.logs import configure_logging
    from rlbus.supervisor import EXIT_BUDGET, Supervisor

    configure_logging("run")
    try:
        roles.preflight(cfg)
    except _input_errors() as exc:
        _fail(str(exc), code=2)
    summary = Supervisor(cfg, plain=plain).run(resume=resume)
    if summary is None:
        raise typer.Exit(1)
    if summary.get("ended") == "wall_budget":  # results written, the steps not all made: not a success, no crash
        typer.secho(f"run {summary['run']}: {summary['ended_note']}", fg="yellow", err=True)
        raise typer.Exit(EXIT_BUDGET)


@app.command()
def worker(
    broker: BrokerOpt = None,
    store: StoreOpt = None,
    config: Annotated[Optional[Path], typer.Option(
        "--config", "-c", help="This worker's own settings (kafka, engine, worker, signing), over the run's.")] = None,
    sets: SetOpt = None,
    region: Annotated[Optional[str], typer.Option(help="The region this worker runs in (worker.region).")] = None,
    hub_store: Annotated[Optional[str], typer.Option(
        "--hub-store", help="--store is this region's replica of the hub's store, and this is the hub's: what the "
        "replica lags on past worker.replica_wait_s is fetched from here (worker.hub_store).")] = None,
    worker_id: Annotated[Optional[str], typer.Option("--id", help="Worker id (default host-pid-random).")] = None,
    metrics_port: MetricsPortOpt = None,
    workflows: Annotated[Optional[list[str]], typer.Option(
        "--workflow", help="Serve only this workflow of the run (repeatable; default: all of them).")] = None,
) -> None:
    """Attach one rollout worker to a running stack (needs only --broker and --store)."""
    overrides = (_overrides(sets, broker) + ([f"worker.region={region}"] if region else [])
                 + ([f"worker.hub_store={hub_store}"] if hub_store else []))
    _load(config, overrides)  # the worker's own settings are checked before anything starts
    from rlbus import roles

    _role("worker", metrics_port=metrics_port, call=lambda: roles.worker(
        store_url=store, config=config, overrides=overrides, worker_id=worker_id, workflows=workflows))


@app.command()
def replica(
    store: StoreOpt = None,
    hub_store: Annotated[Optional[str], typer.Option(
        "--hub-store", help="The hub's weight store URL (worker.hub_store), read over the region's link.")] = None,
    region: Annotated[Optional[str], typer.Option(help="The region whose store this fills (worker.region).")] = None,
    config: Annotated[Optional[Path], typer.Option(
        "--config", "-c", help="The region's settings: store (the replica), worker.hub_store, worker.region, [replica].")] = None,
    sets: SetOpt = None,
    metrics_port: MetricsPortOpt = None,
) -> None:
    """Keep a region's weight store (--store) a verified copy of the hub's (--hub-store): each version crosses once."""
    overrides = (_overrides(sets, store=store) + ([f"worker.region={region}"] if region else [])
                 + ([f"worker.hub_store={hub_store}"] if hub_store else []))
    cfg = _load(config, overrides)
    from rlbus import roles

    _role("replica", metrics_port=metrics_port, call=lambda: roles.replica(cfg))


@app.command()
def link(
    routes: Annotated[list[str], typer.Option(
        "--route", help="[kafka:][LISTEN=]TARGET, e.g. kafka:127.0.0.1:19092=127.0.0.1:9092 (repeatable). A kafka: "
        "route also rewrites the broker's advertised address to LISTEN.")],
    delay_ms: Annotated[float, typer.Option(help="One-way delay, ms.")] = 0.0,
    rate_mbit: Annotated[Optional[float], typer.Option(help="Capacity of each direction, Mbit/s.")] = None,
    drops_per_min: Annotated[float, typer.Option(help="Connections reset at random, on average per minute.")] = 0.0,
    cuts: Annotated[Optional[list[str]], typer.Option(
        "--cut", help="AT_S:FOR_S: cut the link AT_S seconds after it starts, for FOR_S seconds (repeatable).")] = None,
    name: Annotated[str, typer.Option(help="The link's name in logs and stats (the region's).")] = "link",
    stats_file: Annotated[Optional[Path], typer.Option(help="Write the link's counters here (JSON) every second.")] = None,
    control_port: Annotated[Optional[int], typer.Option(
        help="Serve GET /stats, POST /cut and POST /restore on 127.0.0.1:PORT (0: a free port, in the stats).")] = None,
) -> None:
    """Run an emulated WAN link (delay, rate, drops, cuts) in front of the hub's broker and store."""
    from rlbus.link import Link, LinkConfig, LinkCut, parse_address

    try:
        shape = LinkConfig(delay_ms=delay_ms, rate_mbit=rate_mbit, drops_per_min=drops_per_min,
                           cuts=[LinkCut(at_s=float(a), for_s=float(f)) for a, f in (c.split(":") for c in cuts or [])])
        link_ = Link(shape, name=name)
        for route in routes:
            kafka = route.startswith("kafka:")
            listen, _, target = route.removeprefix("kafka:").rpartition("=")
            link_.add_route(parse_address(target), listen=parse_address(listen) if listen else None, kafka=kafka)
    except ValueError as exc:
        _fail(f"rlbus link: {exc}", code=2)
    from rlbus import roles
    from rlbus.link import serve

    def call() -> int:
        link_.start()
        for i in range(len(link_.routes)):
            typer.echo(f"link {name}: {link_.address(i)} -> {routes[i]}")
        stop = roles.stop_on_signals()
        serve(link_, stats_file=stats_file, control_port=control_port, should_stop=stop.is_set)
        return 0

    _role("link", call=call)


@app.command()
def trainer(
    config: ConfigArg = None,
    sets: SetOpt = None,
    broker: BrokerOpt = None,
    store: StoreOpt = None,
    model_dir: Annotated[Path, typer.Option(help="Base model directory (from `rlbus prepare`).")] = Path("base"),
    run_dir: Annotated[Path, typer.Option(help="Directory for metrics and checkpoints.")] = Path("."),
    policy: Annotated[Optional[str], typer.Option(help="The policy to train (default: the run's first).")] = None,
    dataset: Annotated[Optional[Path], typer.Option(
        help="The train dataset the curator reads; needed to re-score groups (intake.rescore).")] = None,
    metrics_port: MetricsPortOpt = None,
) -> None:
    """Run the trainer of one policy of the run."""
    cfg = _load(config, sets, broker, store)
    from rlbus import roles

    _role("trainer", metrics_port=metrics_port, call=lambda: roles.trainer(cfg, model_dir=model_dir, run_dir=run_dir, policy=policy, dataset=dataset))


@app.command()
def curator(
    config: ConfigArg = None,
    sets: SetOpt = None,
    broker: BrokerOpt = None,
    dataset: Annotated[Path, typer.Option(help="Train JSONL (from `rlbus prepare`).")] = Path("data/train.jsonl"),
    metrics: Annotated[Optional[Path], typer.Option(help="Append the curator's counters to this JSONL file.")] = None,
    workflow: Annotated[Optional[str], typer.Option(help="The workflow whose prompts it dispatches (default: the first).")] = None,
    metrics_port: MetricsPortOpt = None,
) -> None:
    """Run the prompt curator of one workflow of the run."""
    cfg = _load(config, sets, broker)
    from rlbus import roles

    _role("curator", metrics_port=metrics_port, call=lambda: roles.curator(cfg, dataset=dataset, metrics_path=metrics, workflow=workflow))


@app.command()
def prepare(
    config: ConfigArg = None,
    sets: SetOpt = None,
    out: Annotated[Path, typer.Option(help="Output directory: base/ model and data/.")] = Path("."),
) -> None:
    """Build the base model (with warm-up) and the dataset; measure held-out accuracy."""
    cfg = _load(config, sets)
    from rlbus import roles
    from rlbus.logs import configure_logging

    configure_logging("prepare")
    typer.echo(json.dumps(roles.prepare(cfg, out)))


@app.command(name="eval")
def evaluate(
    data: Annotated[Path, typer.Option(help="JSONL with prompt/answer rows.")],
    store: StoreOpt = None,
    model_dir: Annotated[Optional[Path], typer.Option(help="Evaluate this directory instead of the store.")] = None,
    config: ConfigArg = None,
    sets: SetOpt = None,
    policy: Annotated[Optional[str], typer.Option(help="The policy to evaluate (default: the run's first).")] = None,
    prepared: Annotated[bool, typer.Option(
        help="--data is a held-out file `rlbus prepare` wrote (standard field names), not read with data.fields.")] = False,
) -> None:
    """Greedy score of a policy's newest weights in --store (or of --model-dir) on a dataset."""
    cfg = _load(config, sets, store=store)
    from rlbus import roles
    from rlbus.logs import configure_logging

    configure_logging("eval")
    try:
        result = roles.evaluate(cfg, data=data, model_dir=model_dir, policy=policy, prepared=prepared)
    except _input_errors() as exc:
        _fail(str(exc), code=2)
    typer.echo(json.dumps(result))


@app.command()
def report(
    run_dir: Annotated[Optional[Path], typer.Argument(help="Run directory `rlbus run` wrote (runs/<run>).")] = None,
    store: Annotated[Optional[str], typer.Option(
        help="Store URL of the run: alone, for a run with nothing on local disk (its trainers mirror their "
             "metrics there); with RUN_DIR, its store when not RUN_DIR/store.")] = None,
    out: Annotated[Optional[Path], typer.Option(
        help="HTML file to write (default RUN_DIR/report.html, or ./report.html with --store alone).")] = None,
) -> None:
    """Write a self-contained HTML report of a run (plots embedded, opens offline)."""
    if run_dir is None and store is None:
        _fail("give a run directory (rlbus report runs/<run>) or --store URL (s3://bucket/prefix)", code=2)
    from rlbus.report.data import ReportError
    from rlbus.report.html import write_html_report
    from weightstore.errors import StoreError

    try:
        path = write_html_report(run_dir, store_url=store, out=out)
    except (ReportError, StoreError) as exc:
        _fail(str(exc), code=2)
    typer.echo(f"report: {path}")


@config_app.command("show")
def config_show(
    config: Annotated[Optional[Path], typer.Argument(help="Run config TOML (default: built-in defaults).")] = None,
    sets: SetOpt = None,
) -> None:
    """Print the config a run would use (file, then RLBUS_* environment, then --set), secrets masked."""
    typer.echo(_load(config, sets).model_dump_json(indent=2))


@config_app.command("schema")
def config_schema() -> None:
    """Print the JSON schema of the run config (every setting, its type, bounds and description)."""
    from rlbus.config import RunConfig

    typer.echo(json.dumps(RunConfig.model_json_schema(), indent=2))


@weights_app.command("ls")
def weights_ls(store: Annotated[str, typer.Option(help="Store URL.")], policy: Optional[str] = None) -> None:
    """List the versions of each policy."""
    from rlbus.weights_cli import weights_ls as impl

    impl(store, policy)


@weights_app.command("show")
def weights_show(store: Annotated[str, typer.Option()], policy: str, version: int) -> None:
    """Print one version's manifest."""
    from rlbus.weights_cli import weights_show as impl

    impl(store, policy, version)


@weights_app.command("verify")
def weights_verify(
    store: Annotated[str, typer.Option()],
    policy: str,
    version: Optional[int] = None,
    all_versions: Annotated[bool, typer.Option("--all", help="Every retained version, not only one.")] = False,
) -> None:
    """Rebuild a version (default: latest; --all: every retained one), check every hash; exit 1 if any fails."""
    from rlbus.weights_cli import weights_verify as impl

    if not impl(store, policy, version, all_versions=all_versions):
        raise typer.Exit(1)


@app.command()
def status(
    broker: Annotated[str, typer.Option("--broker", help="Kafka bootstrap HOST:PORT of the run.")],
    store: Annotated[str, typer.Option("--store", help="The run's store URL: s3://bucket/prefix or a path.")],
    run: Annotated[Optional[str], typer.Option(help="Run name (default: the run the store's descriptor names).")] = None,
    config: ConfigArg = None,
    sets: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the status as one JSON document (a line per "
                                                          "refresh with --watch).")] = False,
    watch: Annotated[bool, typer.Option("--watch", help="Refresh every --interval seconds until interrupted.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between refreshes (--watch, --serve).")] = 5.0,
    window: Annotated[float, typer.Option(help="Seconds of published groups a live worker is judged by.")] = 60.0,
    serve_port: Annotated[Optional[int], typer.Option(
        "--serve", help="Serve /status (JSON) and /metrics (Prometheus) on this port for autoscalers.")] = None,
) -> None:
    """Lag per consumer group, the trainers' version and wait, live workers, propagation and a scaling
    recommendation of a running run, from its broker and store."""
    import json
    import time

    from consumers.status import RunShape, fleet_status
    from rlbus.config import ConfigError, load_config
    from weightstore.config import build_store, store_config_from_url
    from weightstore.errors import NotFound
    from weightstore.modelfiles import read_run_descriptor

    objects = build_store(store_config_from_url(store))
    try:
        descriptor = read_run_descriptor(objects)
    except NotFound as exc:
        _fail(str(exc), code=2)
    try:
        cfg = load_config(config, _overrides(sets, broker), base=descriptor)
    except ConfigError as exc:
        _fail(str(exc), code=2)
    shape = RunShape(run=run or cfg.run.name, policies=[p.name for p in cfg.policy_list()],
                     streams=[w.name for w in cfg.workflow_list()])
    kafka = cfg.kafka

    def compute() -> dict:
        return fleet_status(kafka, objects, shape, window_s=window)

    if serve_port is not None:
        from rlbus.report.status import serve

        server = serve(serve_port, compute, every_s=interval)
        typer.echo(f"serving /status and /metrics on port {serve_port}", err=True)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            server.shutdown()
        return
    from rich.console import Console
    from rich.live import Live

    from rlbus.report.status import render

    from broker.admin import wait_for_broker
    from broker.errors import BrokerError

    try:
        wait_for_broker(kafka, timeout_s=10)
        if as_json:
            while True:
                typer.echo(json.dumps(compute()))
                if not watch:
                    return
                time.sleep(interval)
        if not watch:
            Console().print(render(compute()))
            return
        with Live(render(compute()), refresh_per_second=1, screen=False) as live:
            while True:
                time.sleep(interval)
                live.update(render(compute()))
    except BrokerError as exc:
        _fail(f"{exc}; is --broker the run's broker?", code=1)
    except KeyboardInterrupt:
        return


@app.command()
def stop(
    broker: Annotated[str, typer.Option("--broker", help="Kafka bootstrap HOST:PORT of the run.")],
    store: Annotated[str, typer.Option("--store", help="The run's store URL: s3://bucket/prefix or a path.")],
    reason: Annotated[str, typer.Option(help="Why, for the roles' logs.")] = "stopped by an operator",
    config: ConfigArg = None,
    sets: SetOpt = None,
) -> None:
    """End a run's fleet: its stop record on the control topic ends its curators and every worker attached
    to it, in any region. Trainers do not read it: stop them by a signal (SIGTERM, Ctrl-C), which
    checkpoints and leaves, so a trainer started again resumes."""
    from broker.control import announce_stop
    from broker.errors import BrokerError
    from broker.topics import Topics
    from rlbus.config import ConfigError, load_config
    from weightstore.config import build_store, store_config_from_url
    from weightstore.errors import NotFound
    from weightstore.modelfiles import read_run_descriptor

    try:
        descriptor = read_run_descriptor(build_store(store_config_from_url(store)))
        cfg = load_config(config, _overrides(sets, broker), base=descriptor)
    except (NotFound, ConfigError) as exc:
        _fail(str(exc), code=2)
    try:
        announce_stop(cfg.kafka, Topics(cfg.run.name), cfg.policy().name, reason)
    except BrokerError as exc:
        _fail(f"{exc}; is --broker the run's broker?", code=1)
    typer.echo(f"run {cfg.run.name}: stop record sent ({reason})")


def _check_torchvision() -> None:
    """A torchvision built for another torch breaks transformers' model imports with an error that
    names neither; vLLM's CPU build pulls one in. Say what to do before anything loads a model."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except (RuntimeError, ImportError, OSError) as exc:
        raise SystemExit(
            f"torchvision is installed but does not load with this torch ({exc}). rlbus does not use it; vLLM's "
            "CPU build installs one built for another torch. Remove it: pip uninstall torchvision torchaudio torchcodec"
        ) from exc


def main() -> None:
    if not {"--help", "-h"} & set(sys.argv[1:]) and len(sys.argv) > 1:  # help stays light (no torch import)
        _check_torchvision()
    app()


if __name__ == "__main__":
    main()
