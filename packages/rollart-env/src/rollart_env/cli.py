"""``rollart-env`` console script.

``rollart-env serve --env sokoban --options '{"num_boxes": 2}' --port 8765`` serves a registered
environment over HTTP, one instance per session (see :mod:`rollart_env.remote`); agents and
trainers elsewhere use it as ``impl: remote`` with ``options: {url: ...}``. The first line on stdout
is ``serving <env> on <url>``; SIGTERM/SIGINT close every session and stop. Needs
``pip install 'rollart-env[remote]'``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import Any

from rollart_core.errors import ConfigError, RollartError
from rollart_core.serving import serve_until_signalled


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollart-env", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve an environment over HTTP, one instance per session")
    s.add_argument("--env", required=True, help="environment name (rollart.env entry point) or module:Class")
    s.add_argument("--options", default="{}", help="the environment's config as JSON")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0, help="0 picks a free port")
    s.add_argument("--max-sessions", type=int, default=256, help="sessions held at once (more get 429)")
    s.add_argument(
        "--max-sessions-per-key",
        type=int,
        default=None,
        help="sessions one API key may hold at once (more get 429; default: no quota of its own)",
    )
    s.add_argument(
        "--idle-ttl", type=float, default=600.0, help="seconds before an unused session is closed (0: never)"
    )
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    s.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds to receive a request body (else 408)"
    )
    s.add_argument(
        "--api-key",
        default=None,
        help="bearer token(s) every request must carry, comma-separated (default: $ROLLART_ENV_API_KEY; "
        "prefer the variable, a command line is visible to every user of the machine)",
    )
    s.add_argument("--log-level", default="WARNING")
    return p


async def _serve(args: argparse.Namespace) -> None:
    from rollart_core.registry import build, resolve, validate_options
    from rollart_env.remote import API_KEY_ENV, EnvServer

    try:
        options: Any = json.loads(args.options)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"rollart-env serve: --options is not JSON: {exc}") from None
    if not isinstance(options, dict):
        raise ConfigError("rollart-env serve: --options must be a JSON object")
    validate_options(resolve("env", args.env), options, "--options")  # fail before serving, not per session
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV, "")
    try:
        server = EnvServer(
            lambda: build("env", args.env, options, "--options"),
            host=args.host,
            port=args.port,
            max_sessions=args.max_sessions,
            idle_ttl_s=args.idle_ttl or None,
            max_body_bytes=args.max_body_bytes,
            api_key=api_key,
            max_sessions_per_key=args.max_sessions_per_key,
            body_timeout_s=args.body_timeout,
        )
    except ValueError as exc:
        raise ConfigError(f"rollart-env serve: {exc}") from None
    url = await server.start()
    print(f"serving {args.env} on {url}", flush=True)
    await serve_until_signalled(server.stop)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    try:
        asyncio.run(_serve(args))
    except RollartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
