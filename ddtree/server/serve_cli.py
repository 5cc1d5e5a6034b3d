"""`ddtree serve`: the OpenAI-compatible HTTP server (docs/interfaces.md section 11).

    ddtree serve                                   # the embedded tiny model on 127.0.0.1:8000
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "ddtree-tiny", "prompt": "def fib(n):", "max_tokens": 32, "temperature": 0}'

The engine loads before the port opens (a bad --model is an `Error: <Type>: ...` line, exit 1). Then
uvicorn serves until SIGTERM or Ctrl-C, which drain: no new connections, the requests in flight and in
the queue finish, the worker stops, exit 0 (a second Ctrl-C forces it). Needs the `serve` extra
(fastapi, uvicorn, pydantic, prometheus-client); imported only when the command runs, so the base
install's `ddtree` works without it.
"""
from __future__ import annotations

import signal

import click

from ddtree.cli_types import QuietCommand
from ddtree.errors import reported
from ddtree.server.limits import Limits, limit_options
from ddtree.tree.build import MAX_BUDGET

DEFAULT_MODEL_NAME = "ddtree-tiny"


@click.command("serve", cls=QuietCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="Target checkpoint dir or engine dir from ddtree-build (default: the embedded tiny model).")
@click.option("--drafter", "drafter_dir", type=click.Path(exists=True, file_okay=False), default=None,
              help="DFlash drafter dir (default: the embedded tiny drafter; none with an engine dir).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--budget", type=click.IntRange(1, MAX_BUDGET), default=16, show_default=True,
              help="Drafted tree nodes per DDTree step (root excluded).")
@click.option("--max-queue", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests that may wait for the engine; one more is answered 429 with Retry-After.")
@click.option("--served-model-name", default=None,
              help=f"The model id clients send (default: {DEFAULT_MODEL_NAME} for the embedded model, "
                   "else the --model folder's name).")
@click.option("--skip-verify", is_flag=True,
              help="Engine dir: skip the sha256 of every file (the sizes and config checks still run).")
@limit_options
def serve_command(model_dir, drafter_dir, device, host, port, budget, max_queue, served_model_name, skip_verify,
                  **limit_kw):
    """Serve the model over the OpenAI HTTP API (completions, chat, streaming)."""
    with reported():
        try:
            import uvicorn

            from ddtree.server.app import create_app
        except ImportError as e:
            raise click.ClickException(f"ddtree serve needs the 'serve' extra ({e.name} is missing): "
                                       "pip install -e '.[serve]'") from e
        from pathlib import Path

        from ddtree.runtime.engine import DDTreeEngine
        engine = DDTreeEngine.load(model_dir, drafter_dir, device, verify=not skip_verify)
        name = served_model_name or (Path(model_dir).resolve().name if model_dir else DEFAULT_MODEL_NAME)
        limits = Limits(**limit_kw)
        app = create_app(engine, name, budget=budget, max_queue=max_queue, limits=limits)
        click.echo(f"ddtree serve: model '{name}' ({engine.model_dir}), budget {budget}, "
                   f"max queue {max_queue}", err=True)
    from ddtree.server.limits import deadline_protocol
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False,
                                           http=deadline_protocol(limits),
                                           timeout_graceful_shutdown=limits.shutdown_timeout_s))
    # uvicorn handles SIGTERM / SIGINT itself (graceful shutdown) and, once drained, raises the signal
    # again for the handler it found: this one makes that a normal exit 0 instead of death by signal
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if not server.started:
        raise click.ClickException(f"could not serve on {host}:{port} (see the log above)")
    click.echo("ddtree serve: drained, exiting", err=True)
