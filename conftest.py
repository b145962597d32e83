"""Repository-wide pytest set-up: keep every Ray session started by a test on 127.0.0.1 and stop
Ray from re-creating the uv environment for its workers. Ray reads these variables once, when it
is first imported, so they are set before any test module can import it."""

import os

from rollart_core.resources import LOOPBACK_ENV

for _k, _v in LOOPBACK_ENV.items():
    os.environ.setdefault(_k, _v)
