"""``rollart-proxy``: run the proxy as a stand-alone service.

rollart-proxy serve --config proxy.yaml        # OpenAI-compatible endpoint over running servers
rollart-proxy check-config proxy.yaml          # validate a config and exit
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from rollart_core.errors import RollartError

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rollart-proxy", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd")
    serve = sub.add_parser(
        "serve", help="serve the OpenAI-compatible endpoint over running inference servers"
    )
    serve.add_argument("--config", required=True, help="YAML file (see the package README)")
    serve.add_argument("--log-level", default="INFO")
    serve.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="client key required on every endpoint (repeat for several clients; default: env "
        "ROLLART_PROXY_API_KEY, comma-separated; the environment keeps it out of `ps`)",
    )
    serve.add_argument(
        "--admin-key",
        default=None,
        metavar="KEY",
        help="token for /admin/* (default: env ROLLART_PROXY_ADMIN_KEY)",
    )
    serve.add_argument(
        "--enable-admin",
        action="store_true",
        default=None,
        help="serve /admin/* without an admin key (loopback binds only)",
    )
    check = sub.add_parser("check-config", help="validate a config file")
    check.add_argument("config")
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help()
        return 0
    from rollart_core.extras import require

    if args.cmd == "serve":
        for mod in ("fastapi", "uvicorn", "jinja2"):
            require(mod, "pip install 'rollart-proxy[server]'")
    from rollart_proxy.service import load_config, run_service

    try:
        if args.cmd == "check-config":
            cfg = load_config(args.config)
            print(f"ok: {len(cfg.workers)} worker(s), pools {sorted({w.pool for w in cfg.workers})}")
            return 0
        logging.basicConfig(
            level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        asyncio.run(
            run_service(
                load_config(args.config),
                api_keys=args.api_key,
                admin_key=args.admin_key,
                enable_admin=args.enable_admin,
            )
        )
        return 0
    except RollartError as exc:
        print(f"rollart-proxy: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
