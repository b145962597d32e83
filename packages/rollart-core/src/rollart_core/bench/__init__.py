"""``rollart bench``: the modes side by side on one pipeline.

- :mod:`.harness` — runs the modes interleaved on one pipeline, with the reward executors they share;
- :mod:`.capacity` — each stage's standalone capacity (the compute bound), the natural group
  lifetimes alone (the window bound), the driver's CPU per env and reward call;
- :mod:`.cpu` — every process's CPU time charged to its stage (the CPU-charged bound, the breakdown);
- :mod:`.figures` — throughput, the compute, CPU-charged and staleness-window bounds, ratios and their spread over
  rounds, the reward runtime's counters (pure arithmetic on the segments' records);
- :mod:`.samples` — per-task latency samples of the stages, read off a segment's timeline;
- :mod:`.workload` — the bench's sizes, modes and run config (every part chosen by registry name:
  its straggling environments are rollart-env's ``straggler``, its bursty reward rollart-reward's
  ``bursty``, its elastic reward executor rollart-reward's ``serverless``);
- :mod:`.report` — the printed table, ``summary.md``, ``bench.json``, ``timeline.png``, ``report.html``.

Only the CLI (and ``integration/bench/planner_validation.py``) uses this package.
"""
