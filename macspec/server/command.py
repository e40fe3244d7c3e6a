"""`macspec serve`: the pair behind an OpenAI-compatible HTTP endpoint, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..api.options import GenerationOptions
from ..base.errors import OptionError
from ..cli.common import add_pair_args, announce, generation_options, load_pair

DEFAULT_PORT = 8080


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve the pair over an OpenAI-compatible HTTP API",
        description="Serve TARGET (with DRAFT speculating) at /v1/chat/completions and "
        "/v1/completions, as OpenAI's API does. The generation flags set the defaults a request "
        "can override. Without --target: the embedded default pair.",
    )
    add_pair_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}; 0: any free port"
    )
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 requests")
    p.add_argument(
        "--parallel",
        type=int,
        default=4,
        help="answers made at once, verified in one target pass where the model allows "
        "(else their rounds take turns); more requests wait (default 4)",
    )
    p.add_argument(
        "--no-batch",
        action="store_true",
        help="the answers' rounds take turns instead of sharing the target's passes",
    )
    p.add_argument(
        "--prompt-cache-mb",
        type=float,
        help="MiB of model states kept for prompts that share a beginning (default 1024; 0: off)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..api.pair import prompt_cache
    from .app import create_app
    from .batching import BatchScheduler

    defaults = generation_options(args)
    GenerationOptions.from_kwargs(**defaults)  # a bad flag stops here, not at every request
    if args.parallel < 1:
        raise OptionError(f"invalid --parallel {args.parallel}: must be >= 1")
    if args.api_key is not None and not args.api_key.strip():
        raise OptionError("--api-key must not be empty")
    sock = _bind(args.host, args.port)  # before loading: a taken port fails at once
    pair = load_pair(args)
    if args.prompt_cache_mb is not None:
        pair.prompt_cache = prompt_cache(args.prompt_cache_mb)
    print(announce(pair), file=sys.stderr)
    if not _loopback(args.host) and args.api_key is None:
        print(
            f"[macspec] warning: listening on {args.host} with no authentication: anyone who can "
            "reach this machine can use the model (give --api-key KEY)",
            file=sys.stderr,
        )
    scheduler = BatchScheduler(pair, args.parallel, batch=not args.no_batch)
    app = create_app(pair, scheduler, api_key=args.api_key, defaults=defaults)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=30
    )
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    ready = (
        f"[macspec] serving {pair.target_path.name} at http://{shown}:{port}/v1 "
        "(OpenAI-compatible; Ctrl-C stops)"
    )
    server = _server(config, scheduler, ready)
    try:
        server.run(sockets=[sock])
    finally:
        scheduler.close()
        scheduler.shutdown()  # MLX's thread freed and joined before the interpreter exits
    print("[macspec] stopped", file=sys.stderr)
    return 0


def _server(config: Any, scheduler: Any, ready: str) -> Any:
    """uvicorn's Server, which says `ready` once it takes connections (after the scheduler's
    startup check), and whose Ctrl-C / SIGTERM first ends the answers in flight (at their next
    round, so that their streams close properly), then exits with status 0."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                print(ready, file=sys.stderr, flush=True)

        def handle_exit(self, sig: int, frame: Any) -> None:
            scheduler.close()
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal once it has stopped: a clean stop exits 0 instead
            getattr(self, "_captured_signals", []).clear()

    return Server(config)


@contextmanager
def serving(
    pair: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    parallel: int = 4,
    scheduler: Any = None,
    batch: bool = True,
    **app: Any,
) -> Iterator[str]:
    """The server in a thread of this process (tests, benchmarks); yields its base URL. `app`:
    create_app's options (api_key, defaults, max_body); `scheduler`: one made already;
    `batch`: requests share target passes where the pair allows (else they take turns)."""
    import uvicorn

    from .app import create_app
    from .batching import BatchScheduler

    scheduler = scheduler or BatchScheduler(pair, parallel, batch)
    sock = _bind(host, port)
    config = uvicorn.Config(create_app(pair, scheduler, **app), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="macspec-serve")
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        scheduler.close()
        server.should_exit = True
        thread.join()
        scheduler.shutdown()


def _bind(host: str, port: int) -> socket.socket:
    if not 0 <= port < 65536:
        raise OptionError(f"invalid --port {port}: must be in 0..65535")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise OptionError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
