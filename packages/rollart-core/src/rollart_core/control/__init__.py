"""The control plane: the training loop as short mode recipes over named primitives.

- :mod:`.train` — ``train(cfg)`` picks the recipe of ``loop.mode`` and runs it step by step;
- :mod:`.sync`, :mod:`.one_off`, :mod:`.asynchronous` — one recipe per mode, each readable top to bottom;
- :mod:`.steps` — the primitives: ``get_batch``, ``sync_weights``, ``train_step``, ``push``, ``abort_stale``;
- :mod:`.admission` — async admission (``on_time``, ``next_task``, the producer);
- :mod:`.state` — ``RunState``, the one owner of a run's changing state (versions, groups, fates,
  failure) and its one signal; every fate is assigned there;
- :mod:`.clock` — the rules of the trained / served / coming / last-batch versions;
- :mod:`.ledger` — every trajectory's fate, counted once.
- :mod:`.pipeline` — builds a run's components from its config (and tears them down);
- :mod:`.rollout` — launches groups of trajectories, tracks them in flight, aborts the stale ones;
- :mod:`.runner` — drives one trajectory env ↔ proxy ↔ reward (``run_trajectory``);
- :mod:`.buffer` — the SampleBuffer: a run's groups from launch until taken, behind the staleness gate;
- :mod:`.checkpoint` — checkpoints of a whole run, written as one unit.

Nothing here imports torch, vLLM or Ray at import time.
"""
