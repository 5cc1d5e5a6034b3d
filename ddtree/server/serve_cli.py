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

import logging
import signal
import sys
from pathlib import Path

import click

from ddtree.cli_types import SAMPLING_DEFAULTS, QuietCommand
from ddtree.errors import InputError, reported
from ddtree.model.jinja_template import read_chat_template
from ddtree.model.tokenizer import use_chat_template
from ddtree.runtime.engine import DDTreeEngine
from ddtree.runtime.loop import context_of
from ddtree.runtime.run_cli import BudgetParam
from ddtree.server.limits import Limits, deadline_protocol, limit_options

DEFAULT_MODEL_NAME = "ddtree-tiny"


@click.command("serve", cls=QuietCommand, context_settings={"help_option_names": ["-h", "--help"]},
               epilog=SAMPLING_DEFAULTS)
@click.option("--model", "model_dir", default=None,
              help="Target checkpoint dir, engine dir from ddtree-build, or a Hugging Face Hub id owner/name[@rev] "
                   "(downloaded to, or offline read from, the Hub cache). Default: the embedded tiny model.")
@click.option("--drafter", "drafter_dir", default=None,
              help="DFlash drafter dir or Hub id (default: the embedded tiny drafter; none with an engine dir).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--kernel-plan", type=click.Choice(["fast", "batch-invariant"]), default="fast", show_default=True,
              help="--device cuda: batch-invariant fixes every kernel's split for all row counts, so an answer is "
                   "bitwise the same whatever runs beside it (slower).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--budget", type=BudgetParam(), default="16", show_default=True,
              help="Drafted tree nodes per DDTree step (root excluded), or 'auto' (per step, from an engine "
                   "dir's tuning file: `ddtree tune ENGINE_DIR`).")
@click.option("--prune", type=click.Choice(["off", "auto"]), default="off", show_default=True,
              help="auto: prune every request's trees inside the verify by expert cost (issue 53; lossless; --device "
                   "cpu with an engine dir or --device cuda at tp 1, --max-num-seqs 1).")
@click.option("--max-queue", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests that may wait for the engine; one more is answered 429 with Retry-After.")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Requests generated at once (continuous batching: a request joins the running batch at the next "
                   "step and leaves when done); on --device cuda each request holds a lane (its own caches) and "
                   "the lanes' DDTree steps run as one batched graph.")
@click.option("--served-model-name", "served_model_names", multiple=True,
              help=f"A model id clients may send; repeat it for several (the first names the metrics). Default: "
                   f"{DEFAULT_MODEL_NAME} for the embedded model, else the --model folder's name.")
@click.option("--skip-verify", is_flag=True,
              help="Engine dir: skip the sha256 of every file (the sizes and config checks still run).")
@click.option("--api-key", default=None, envvar="DDTREE_API_KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/* (401 otherwise; /health, /metrics stay open). "
                   "Env: DDTREE_API_KEY.")
@click.option("--allowed-origins", default=None,
              help="CORS: comma-separated origins browsers may call from ('*': any). Default: no CORS headers.")
@click.option("--max-model-len", type=click.IntRange(min=2), default=None,
              help="The context the server allows, prompt + new tokens (default and maximum: the model's).")
@click.option("--chat-template", "chat_template", type=click.Path(dir_okay=False), default=None,
              help="A jinja2 chat template file to render chat prompts with, instead of the checkpoint's own.")
@click.option("--disable-log-requests", is_flag=True,
              help="No log line per request (default: one each: id, status, tokens, latency).")
@limit_options
def serve_command(model_dir, drafter_dir, device, kernel_plan, host, port, budget, prune, max_queue, max_num_seqs,
                  served_model_names, skip_verify, api_key, allowed_origins, max_model_len, chat_template,
                  disable_log_requests, **limit_kw):
    """Serve the model over the OpenAI HTTP API (completions, chat, streaming)."""
    with reported():
        try:
            import uvicorn  # uvicorn: the serve extra

            from ddtree.server.app import create_app  # fastapi, prometheus_client, pydantic, starlette: the serve extra
        except ImportError as e:
            raise click.ClickException(f"ddtree serve needs the 'serve' extra ({e.name} is missing): "
                                       "pip install -e '.[serve]'") from e

        engine = DDTreeEngine.load(model_dir, drafter_dir, device, verify=not skip_verify, kernel_plan=kernel_plan)
        if budget == "auto":
            engine.auto_budget()                        # refused now (naming the tuning file), not per request
        if prune == "auto" and max_num_seqs > 1:
            raise InputError("--prune auto prunes inside the one-request verify; the continuous-batching scheduler "
                             f"(--max-num-seqs {max_num_seqs}) does not: use --max-num-seqs 1 or --prune off")
        engine.pruner(prune)                            # --prune auto refused now (naming the executor)
        context = context_of(engine.config)
        if max_model_len is not None and max_model_len > context:
            raise InputError(f"--max-model-len {max_model_len} is more than the model's context ({context} "
                             f"tokens, max_position_embeddings of {engine.model_dir / 'config.json'})")
        if chat_template is not None:
            use_chat_template(engine.tokenizer, read_chat_template(chat_template).text, chat_template)
        names = list(served_model_names) or [(model_dir if not Path(model_dir).is_dir() else
                                              Path(model_dir).resolve().name) if model_dir else DEFAULT_MODEL_NAME]
        origins = [o.strip() for o in allowed_origins.split(",") if o.strip()] if allowed_origins else None
        if not disable_log_requests:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
            logging.getLogger("ddtree.serve").addHandler(handler)
            logging.getLogger("ddtree.serve").setLevel(logging.INFO)
        limits = Limits(**limit_kw)
        app = create_app(engine, names, budget=budget, prune=prune, max_queue=max_queue, api_key=api_key,
                         allowed_origins=origins, max_model_len=max_model_len,
                         log_requests=not disable_log_requests, limits=limits, max_num_seqs=max_num_seqs)
        click.echo(f"ddtree serve: model {', '.join(repr(n) for n in names)} ({engine.model_dir}), budget {budget}, "
                   f"max queue {max_queue}, max num seqs {max_num_seqs}, context {max_model_len or context}"
                   + (", API key required" if api_key else ""), err=True)
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
