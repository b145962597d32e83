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
    parser = argparse.ArgumentParser(prog="rollart-proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd")
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible endpoint over running inference servers")
    serve.add_argument("--config", required=True, help="YAML file (see the package README)")
    serve.add_argument("--log-level", default="INFO")
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
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        asyncio.run(run_service(load_config(args.config)))
        return 0
    except RollartError as exc:
        print(f"rollart-proxy: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
