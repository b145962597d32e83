"""Fast checks of the proxy's pure parts: configs, wire-format parsing, metrics, import lightness.
The routing, engines and HTTP paths run against real vLLM in integration/tests/test_proxy_*.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollart_core.errors import ConfigError, EngineError
from rollart_proxy import LLMProxy, WorkerHandle
from rollart_proxy.errors import WorkerUnavailableError
from rollart_proxy.metrics import WorkerMetrics


class _Unused:
    """Stands for an engine in constructor checks that never call it."""


def test_proxy_rejects_bad_topologies() -> None:
    with pytest.raises(EngineError, match="at least one worker"):
        LLMProxy([])
    with pytest.raises(EngineError, match="unique"):
        LLMProxy([WorkerHandle("a", _Unused()), WorkerHandle("a", _Unused())])  # type: ignore[arg-type]
    with pytest.raises(EngineError, match="pools without workers"):
        LLMProxy([WorkerHandle("a", _Unused(), pool="H20")], task_pools={"math": "H800"})  # type: ignore[arg-type]
    with pytest.raises(EngineError, match="max_inflight"):
        WorkerHandle("a", _Unused(), max_inflight=0)  # type: ignore[arg-type]
    assert issubclass(WorkerUnavailableError, EngineError)


def test_worker_metrics_track_suspension_and_tokens() -> None:
    m = WorkerMetrics()
    m.record(10, 5, "length")
    m.record(3, 0, "abort")
    m.suspend()
    m.suspend()  # idempotent
    m.unsuspend()
    m.add_suspended(0.5)
    s = m.snapshot(inflight=2)
    assert s["prefill_tokens"] == 13 and s["decode_tokens"] == 5 and s["aborted"] == 1
    assert s["queue_depth"] == 2 and s["suspended_s"] >= 0.5 and not s["suspended"] and s["tokens_per_s"] > 0


def test_service_config_validation(tmp_path: Path) -> None:
    from rollart_proxy.service import load_config

    good = tmp_path / "ok.yaml"
    good.write_text(
        "model: /m\nworkers:\n  - {url: 'http://127.0.0.1:1', pool: H20}\ntask_pools: {agent: H20}\n"
    )
    assert load_config(good).workers[0].pool == "H20"
    for text, msg in [
        ("model: /m\nworkers: []\n", "at least 1"),
        ("model: /m\nworkers:\n  - {url: 'http://x', bogus: 1}\n", "bogus"),
        ("model: /m\nworkers:\n  - {url: 'http://x'}\ntask_pools: {a: H800}\n", "pools without workers"),
        ("model: /m\nworkers:\n  - {url: 'http://x', kind: trt}\n", "kind"),
        ("model: [unclosed\n", "cannot read"),
    ]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=msg):
            load_config(bad)


def test_cli_check_config_reports_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: /m\nworkers:\n  - {url: 'http://x', max_inflight: 0}\n")
    r = subprocess.run(
        [sys.executable, "-m", "rollart_proxy.cli", "check-config", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "max_inflight" in r.stderr


def test_sglang_stream_chunks_cumulative_and_incremental() -> None:
    from rollart_proxy.engines.sglang_server_engine import SglangServerEngine

    cum = {
        "completion_tokens": 3,
        "output_token_logprobs": [[-1.0, 5, None], [-2.0, 6, None], [-3.0, 7, None]],
    }
    assert SglangServerEngine._new_tokens(cum, 2) == [[-3.0, 7, None]]
    inc = {"completion_tokens": 3, "output_token_logprobs": [[-3.0, 7, None]]}
    assert SglangServerEngine._new_tokens(inc, 2) == [[-3.0, 7, None]]


def test_version_spans_to_per_token_versions() -> None:
    from rollart_proxy.engines.vllm_server_engine import _versions_from_spans

    spans = [{"version": "0", "start": 0, "end": 2}, {"version": "1", "start": 2, "end": 5}]
    assert _versions_from_spans(spans, 5) == [0, 0, 1, 1, 1]
    assert _versions_from_spans(spans, 6) is None  # spans that do not cover the output are not trusted
    assert _versions_from_spans([{"version": "default", "start": 0, "end": 5}], 5) is None


def test_import_is_light() -> None:
    code = (
        "import sys, json, rollart_proxy, rollart_proxy.service, rollart_proxy.cli\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'torch','vllm','ray','fastapi','uvicorn','sglang'})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
