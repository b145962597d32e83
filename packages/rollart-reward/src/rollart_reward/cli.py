"""``rollart-reward`` console script.

``rollart-reward serve --function math_verify --port 8700 --max-workers 16 --idle-timeout 30``
serves a registered reward function over HTTP with autoscaling (see :mod:`rollart_reward.runtime`).
The first line on stdout is ``serving <function> on <url>``; SIGTERM/SIGINT stop it and its workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from rollart_core.errors import ConfigError
from rollart_core.serving import serve_until_signalled


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollart-reward", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve a reward function over HTTP with autoscaling")
    s.add_argument(
        "--function", required=True, help="reward name (rollart.reward entry point) or module:Class"
    )
    s.add_argument("--options", default="{}", help="the function's config as JSON")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0, help="0 picks a free port")
    s.add_argument("--min-workers", type=int, default=0)
    s.add_argument("--max-workers", type=int, default=8)
    s.add_argument("--idle-timeout", type=float, default=2.0, help="seconds before an idle worker stops")
    s.add_argument(
        "--idle-policy",
        choices=("fixed", "ski_rental", "learned"),
        default="learned",
        help="keep-alive of idle workers: exactly --idle-timeout, at least a cold start's cost, "
        "or learned from recent idle periods (at most the ski-rental value)",
    )
    s.add_argument("--call-timeout", type=float, default=60.0)
    s.add_argument("--max-queue", type=int, default=10_000, help="waiting calls beyond this get 429")
    s.add_argument("--cache-size", type=int, default=100_000, help="idempotency cache entries")
    s.add_argument("--max-body-bytes", type=int, default=16 << 20, help="larger request bodies get 413")
    s.add_argument(
        "--body-timeout", type=float, default=30.0, help="seconds to receive a request body (else 408)"
    )
    s.add_argument("--max-batch", type=int, default=1024, help="most items in one batch request")
    s.add_argument("--max-async-tasks", type=int, default=10_000, help="async calls held at once")
    s.add_argument(
        "--api-key",
        default=None,
        help="bearer token every request must carry (default: $ROLLART_REWARD_API_KEY; "
        "prefer the variable, a command line is visible to every user of the machine)",
    )
    s.add_argument(
        "--admin",
        action="store_true",
        help="enable /admin/* (fault knobs, stats reset) without an admin key: tests on loopback only",
    )
    s.add_argument(
        "--admin-key",
        default=None,
        help="bearer token of /admin/*, apart from --api-key (default: $ROLLART_REWARD_ADMIN_KEY); "
        "enables them",
    )
    s.add_argument("--faults", default="{}", help="fault injection config as JSON (tests)")
    s.add_argument("--log-level", default="WARNING")
    return p


async def _serve(args: argparse.Namespace) -> None:
    import os

    from rollart_reward.runtime import (
        ADMIN_KEY_ENV,
        API_KEY_ENV,
        FaultConfig,
        FunctionRuntime,
        RuntimeConfig,
    )

    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    admin_key = args.admin_key if args.admin_key is not None else os.environ.get(ADMIN_KEY_ENV) or None
    try:
        cfg = RuntimeConfig(
            function=args.function,
            options=json.loads(args.options),
            host=args.host,
            port=args.port,
            min_workers=args.min_workers,
            max_workers=args.max_workers,
            idle_timeout_s=args.idle_timeout,
            idle_policy=args.idle_policy,
            call_timeout_s=args.call_timeout,
            max_queue=args.max_queue,
            cache_size=args.cache_size,
            max_body_bytes=args.max_body_bytes,
            body_timeout_s=args.body_timeout,
            max_batch=args.max_batch,
            max_async_tasks=args.max_async_tasks,
            api_key=api_key,
            admin=args.admin,
            admin_key=admin_key or None,
            faults=FaultConfig.model_validate(json.loads(args.faults)),
        )
    except (ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(f"rollart-reward serve: {exc}") from None
    from rollart_core.registry import resolve

    resolve("reward", cfg.function)  # fail fast on an unknown name, before any worker starts
    rt = FunctionRuntime(cfg)
    url = await rt.start()
    print(f"serving {cfg.function} on {url}", flush=True)
    await serve_until_signalled(rt.stop)


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    try:
        asyncio.run(_serve(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
