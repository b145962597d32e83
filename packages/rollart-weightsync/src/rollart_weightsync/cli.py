"""``rollart-weightsync``: run a Mooncake weight store (master + holder) in the foreground."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollart-weightsync", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start mooncake_master and a store holder; Ctrl-C stops both")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--rpc-port", type=int, default=None, help="master RPC port (default: a free one)")
    serve.add_argument(
        "--metrics-port", type=int, default=None, help="master metrics port (default: a free one)"
    )
    serve.add_argument("--segment-gib", type=float, default=1.0, help="memory the holder contributes (GiB)")
    serve.add_argument("--protocol", default="tcp", choices=["tcp", "rdma"])
    serve.add_argument("--rdma-devices", default="")
    serve.add_argument(
        "--shared-memory",
        action="store_true",
        help="run the holder as Mooncake's real client: clients on this host that set "
        "real_client (printed) reach it through shared memory",
    )
    args = parser.parse_args(argv)

    from rollart_core.errors import RollartError
    from rollart_weightsync.mooncake_server import MooncakeServerConfig, MooncakeStoreServer

    try:
        cfg = MooncakeServerConfig(
            host=args.host,
            rpc_port=args.rpc_port,
            metrics_port=args.metrics_port,
            segment_bytes=int(args.segment_gib * (1 << 30)),
            protocol=args.protocol,
            rdma_devices=args.rdma_devices,
            shared_memory=args.shared_memory,
        )
        server = MooncakeStoreServer(cfg)
        server.start()
    except (RollartError, ValueError) as exc:
        print(f"rollart-weightsync: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(
        json.dumps(
            {
                "master": server.master_address,
                "metrics_port": server.metrics_port,
                "master_pid": server.master.pid if server.master else None,
                "holder_pid": server.holder.pid if server.holder else None,
                "real_client": server.store_config().real_client,
            }
        ),
        flush=True,
    )
    try:
        stop.wait()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
