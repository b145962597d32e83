"""Planning (``rollart plan``): which hardware serves each task, how big each pool is, and what a
plan's throughput will be, before anything is started.

- :mod:`.planner` — the roofline planner (pools per hardware class, the limiting stage);
- :mod:`.trainer` — the trainer pool from 6·N·tokens FLOPs and the budget's split per mode;
- :mod:`.simulate` — a discrete-event simulation of the pipeline (Sync+ vs async throughput);
- :mod:`.catalogue` — the hardware classes the planner chooses from;
- :mod:`.workload` — task profiles, given by hand or measured from a run;
- :mod:`.cli` — ``rollart plan`` behind the command line.

Only the CLI and the benchmarks use this package; it imports no Ray, torch or vLLM.
"""
