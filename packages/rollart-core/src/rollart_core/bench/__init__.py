"""``rollart bench``: the modes side by side on one pipeline.

- :mod:`.harness` — runs the modes interleaved, measures each stage's capacity, aggregates the figures;
- :mod:`.workload` — the bench's sizes, modes and run config (every part chosen by registry name:
  its straggling environments are rollart-env's ``straggler``, its bursty reward rollart-reward's
  ``bursty``);
- :mod:`.report` — the printed table, ``summary.md``, ``bench.json``, ``timeline.png``, ``report.html``.

Only the CLI uses this package.
"""
