"""RayTrainerGroup: the trainer as a placed, restartable group of Ray actors, one per rank.

Where :class:`~rollart_train.TorchTrainer` runs its ranks in the driver or in processes spawned on the
driver's host, this group puts every rank in its own Ray actor on a node of the trainer's pool (a Ray
custom resource or GPU model, :mod:`rollart_core.resources`) and drives them from the caller:

- **Placement**: one :class:`~rollart_core.resources.WorkerDecl` ``"trainer"`` with ``count = ranks``
  goes through :func:`rollart_core.resources.place` (validated first: a pool the cluster lacks or one
  too small raises ConfigError before any actor starts); rank ``r`` is created with
  ``Placement.actor_options(name, r)`` (a built group places itself as ``trainer-<id>``, since Ray's
  placement group names are unique). :meth:`RayTrainerGroup.validate` runs the same check
  statically, so a pipeline can refuse a plan before it starts its engines.
- **Rendezvous**: rank 0's actor reports its node IP and a free port there; every rank then joins
  ``torch.distributed`` (gloo on CPU, NCCL with ``device: cuda``) at that address and builds its rank
  worker (:func:`rollart_train._rendezvous.start_rank_worker`): a
  :class:`~rollart_train.torch_rank.TorchRankWorker` (``worker: torch``) or a
  :class:`~rollart_train.megatron_rank.MegatronRankWorker` (``worker: megatron``, which then sets up
  Megatron's tensor / pipeline / data-parallel groups). One torch rank: no process group.
- **Calls** are collective (every rank gets the same arguments; a batch is ``ray.put`` once and every
  rank takes its own shard); rank 0's answer is returned.
- **Weights**: :meth:`RayTrainerGroup.push_weights` gathers the full state dict on rank 0 (every rank
  joins ``full_weights``, an all-gather per tensor) and rank 0 pushes it to the weight store itself, so
  the weights never pass through the driver. Gathered-on-rank-0 rather than one push per rank's shard
  because the stores' layout is one full Hugging Face state dict per version, committed once (a
  per-shard push would need a multi-writer commit protocol in every back-end), and inference workers pull
  full tensors under HF names (they shard differently from FSDP, so shards would be re-assembled on the
  reader side anyway). The gather costs one extra copy of the weights in rank 0's host memory.
- **Restarts**: when a rank actor dies (``RayActorError``: a crash, ``kill -9``, its node lost) or a call
  exceeds ``call_timeout_s``, every rank of the group is killed (the survivors' collectives are broken)
  and, while ``restarts < max_restarts``, all ranks are rebuilt in the same placement group from the
  newest ``checkpoint-<n>`` in ``checkpoint_dir`` (the initial model if none) and the failed call is
  retried once. Versions stay monotone: the restored weights continue under the group's version, and
  the retried call's metrics carry ``trainer_restarts``, ``restart_s``, ``restored_version`` and
  ``lost_steps``. With the budget spent the call raises TrainerError naming the rank, its node and the
  budget.

Importing this module imports neither ray nor torch (they are imported inside the functions that use
them); the rank actor class is turned into a Ray actor when a group is built.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollart_core.errors import ConfigError, RollartError, TrainerError
from rollart_core.extras import require
from rollart_core.resources import AffinitySpec, ClusterView, WorkerDecl
from rollart_core.types import Trajectory
from rollart_train._checkpoint import find_checkpoint, read_state
from rollart_train._rank_actor import _RankActor
from rollart_train._ray_group_config import _WORKERS, RayTrainerGroupConfig, _placement_message

if TYPE_CHECKING:
    import torch

    from rollart_core.protocols import WeightStore
    from rollart_core.resources import Placement

__all__ = ["RayTrainerGroup", "RayTrainerGroupConfig"]

log = logging.getLogger(__name__)

_GRACE_S = 5.0
"""After a rank raised, how long to wait for the other ranks before treating the group as diverged."""


class _RankFailed(Exception):
    """A rank died or a call timed out: the group's ranks are no longer usable."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(reason)
        self.rank, self.reason = rank, reason


class RayTrainerGroup:
    """rollart's Trainer (plus ``load``, ``push_weights``) over ``ranks`` placed Ray actors.

    Needs a running Ray (the pipeline's ``RayCluster``). ``weight_store`` is the store
    :meth:`push_weights` writes to from rank 0 (it travels to the actor pickled, as it does to engines).
    """

    Config = RayTrainerGroupConfig

    def __init__(
        self,
        config: RayTrainerGroupConfig | Mapping[str, Any] | None = None,
        *,
        model_path: str | Path,
        weight_store: WeightStore | None = None,
    ) -> None:
        if config is None or isinstance(config, Mapping):
            try:
                config = RayTrainerGroupConfig.model_validate(dict(config or {}))
            except ValueError as exc:
                raise ConfigError(f"RayTrainerGroup: {exc}") from None
        self.config = config
        self.model_path = Path(model_path)
        self.weight_store = weight_store
        self.rank_config = config.rank_config()
        self.version = 0
        self.restarts = 0
        self.weights_to_caller = 0
        """How many times full weights were brought to the caller (:meth:`named_weights`)."""
        self.resumed_state: dict[str, Any] = {}
        self._name = f"rollart-trainer-{uuid.uuid4().hex[:8]}"
        self._decl = self.worker_decl(config, name=self._name.removeprefix("rollart-"))
        self._placement: Placement | None = None
        self._actor_cls: Any = None
        self._actors: list[Any] = []
        self._pids: list[int] = []
        self._node_ids: list[str] = []
        self._closed = False
        self._serial = threading.RLock()
        """Collective calls go to every rank in the same order: callers in several threads (a push
        beside a checkpoint save) take turns here."""
        self._generation = 0
        self._pending_restart: dict[str, float] = {}
        self._lost = _RankFailed(0, "no live ranks")
        """Why the group has no ranks (a failure that killed them), for the next call's restart."""
        ray = require("ray", "pip install 'rollart-core[ray]'")
        try:
            self._placement = self._place()
            self._actor_cls = ray.remote(_RankActor)
            resume = self.rank_config.resume_from
            self.resumed_state = self._build(Path(resume) if resume else None, None)
            self.version = int(self.resumed_state["version"])
        except BaseException:
            self.close()
            raise

    # placement -------------------------------------------------------------------------------

    @staticmethod
    def worker_decl(config: RayTrainerGroupConfig, name: str = "trainer") -> WorkerDecl:
        """The group's resource demand, for the pipeline's plan (``validate_plan`` / ``place``). A built
        group places itself under a name of its own (``trainer-<id>``: Ray placement group names are
        unique, and two groups may share a cluster)."""
        return WorkerDecl(
            name,
            AffinitySpec(
                pool=config.pool,
                num_cpus=config.num_cpus_per_rank,
                num_gpus=config.num_gpus_per_rank,
                count=config.ranks,
            ),
            "trainer",
        )

    @classmethod
    def validate(cls, config: RayTrainerGroupConfig, cluster: ClusterView) -> list[str]:
        """Check that ``cluster`` can host the group (no actor starts); returns the node id per rank.
        ConfigError naming the pool, the rank count and the pools that exist otherwise."""
        from rollart_core.resources import validate_plan

        try:
            return validate_plan([cls.worker_decl(config)], cluster)["trainer"]
        except ConfigError as exc:
            raise ConfigError(_placement_message(config, cluster, exc)) from None

    def _place(self) -> Placement:
        from rollart_core.resources import place

        cluster = ClusterView.from_ray()
        self.validate(self.config, cluster)
        return place([self._decl], cluster, timeout_s=self.config.placement_timeout_s)

    # ranks -----------------------------------------------------------------------------------

    def _build(self, resume_from: Path | None, version: int | None) -> dict[str, Any]:
        """Start every rank (from ``resume_from`` or the initial model; under ``version`` if given)."""
        if self._placement is None:
            raise TrainerError("the trainer group is closed")
        n, c = self.config.ranks, self.config
        t0 = time.monotonic()
        cfg = self.rank_config.model_copy(update={"resume_from": str(resume_from) if resume_from else None})
        self._generation += 1
        self._actors = []
        for r in range(n):  # appended one by one: a failure half-way still kills those created
            self._actors.append(
                self._actor_cls.options(
                    **self._placement.actor_options(self._decl.name, r),
                    name=f"{self._name}-g{self._generation}-rank{r}",
                    max_restarts=0,
                    max_task_retries=0,
                ).remote(r)
            )
        try:
            identities = self._gather(
                [a.identity.remote() for a in self._actors], "start", c.placement_timeout_s, every=True
            )
            self._pids = [int(pid) for pid, _ in identities]
            self._node_ids = [str(node) for _, node in identities]
            master = self._gather([self._actors[0].address.remote()], "start", c.placement_timeout_s)
        except BaseException:
            self._kill()
            raise
        threads = max(1, int(c.num_cpus_per_rank))
        started = time.monotonic()
        try:
            state = self._gather(
                [
                    a.setup.remote(
                        _WORKERS[c.worker][1],
                        cfg,
                        str(self.model_path),
                        n,
                        master,
                        self.weight_store,
                        version,
                        threads,
                    )
                    for a in self._actors
                ],
                "start",
                c.placement_timeout_s,
            )
        except BaseException:
            self._kill()  # half-started ranks are of no use
            raise
        log.debug(
            "trainer ranks: actors up in %.2fs, model loaded and process group joined in %.2fs",
            started - t0,
            time.monotonic() - started,
        )
        return state

    def _kill(self) -> None:
        import ray

        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already gone, or the cluster is going away
                log.debug("killing a trainer rank: %r", exc)
        self._actors = []

    def _gather(self, refs: list[Any], what: str, timeout: float, every: bool = False) -> Any:
        """Rank 0's answer (``every``: all answers). Raises _RankFailed on a death or a timeout."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        rank_of = {ref: r for r, ref in enumerate(refs)}
        pending = list(refs)
        deadline = time.monotonic() + timeout
        app_error: tuple[int, RayTaskError] | None = None
        while pending:
            left = deadline - time.monotonic()
            if app_error is not None:  # a rank raised: the others get a short grace, then count as hung
                left = min(left, _GRACE_S)
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0))
            if not ready:
                if app_error is not None:
                    break
                raise _RankFailed(rank_of[pending[0]], f"{what} timed out after {timeout:g}s")
            try:
                ray.get(ready[0])
            except RayActorError as exc:
                raise _RankFailed(
                    rank_of[ready[0]], f"{what}: the rank's actor died ({type(exc).__name__})"
                ) from exc
            except RayTaskError as exc:
                app_error = app_error or (rank_of[ready[0]], exc)
        if app_error is not None:
            rank, task_error = app_error
            raised = getattr(task_error, "cause", None)
            cause = raised if isinstance(raised, BaseException) else task_error
            if pending:  # the others are stuck in a collective the failed rank left: the group diverged
                raise _RankFailed(
                    rank, f"{what} raised {cause!r} on rank {rank} while other ranks waited in a collective"
                ) from task_error
            if isinstance(cause, RollartError):  # every rank raised it: the group is still consistent
                raise cause
            raise TrainerError(f"trainer rank {rank}: {what} failed: {cause!r}") from task_error
        out = ray.get(refs)
        return out if every else out[0]

    def _call(self, what: str, submit: Callable[[list[Any]], list[Any]]) -> tuple[Any, dict[str, float]]:
        """Run one collective call (``submit`` sends it to every rank); on a rank failure restart the
        group within the budget and retry once. Returns rank 0's answer and the restart's metrics."""
        with self._serial:
            out, restart = self._call_serial(what, submit)
            if restart:  # reported with the next train step's metrics, whichever call restarted
                self._pending_restart = restart
            return out, restart

    def _call_serial(
        self, what: str, submit: Callable[[list[Any]], list[Any]]
    ) -> tuple[Any, dict[str, float]]:
        if self._closed:
            raise TrainerError("the trainer group is closed")
        restart: dict[str, float] = {}
        if not self._actors:  # an earlier failure left the group without ranks
            restart = self._restart(self._lost)
        try:
            return self._gather(submit(self._actors), what, self.config.call_timeout_s), restart
        except _RankFailed as failure:
            restart = self._restart(failure)
        try:
            return self._gather(submit(self._actors), what, self.config.call_timeout_s), restart
        except _RankFailed as failure:
            self._kill()
            self._lost = failure
            raise TrainerError(
                f"trainer rank {failure.rank} failed again right after a restart: {failure.reason}"
            ) from failure

    def _restart(self, failure: _RankFailed) -> dict[str, float]:
        """Kill every rank; rebuild them all from the newest checkpoint (within the budget)."""
        c = self.config
        rank, reason = failure.rank, failure.reason
        node = self._node_ids[rank] if rank < len(self._node_ids) else "?"
        self._kill()
        self._lost = failure
        if self._closed:
            raise TrainerError(
                f"the trainer group was closed while rank {rank} failed ({reason})"
            ) from failure
        if self.restarts >= c.max_restarts:
            raise TrainerError(
                f"trainer rank {rank} on node {node} failed ({reason}) and the restart budget is "
                f"spent ({self.restarts} of max_restarts={c.max_restarts} used)"
            ) from failure
        t0 = time.monotonic()
        self.restarts += 1
        ckpt = _newest_checkpoint(c.checkpoint_dir)
        restored = _checkpoint_version(ckpt) if ckpt is not None else 0
        version = max(self.version, restored)
        log.warning(
            "trainer rank %d on node %s failed (%s): restart %d of %d from %s (version %d, group at "
            "version %d: %d step(s) lost)",
            rank,
            node,
            reason,
            self.restarts,
            c.max_restarts,
            ckpt or "the initial model",
            restored,
            self.version,
            max(self.version - restored, 0),
        )
        try:
            self._build(ckpt, version)
        except _RankFailed as again:
            self._lost = again
            raise TrainerError(
                f"trainer rank {again.rank} failed while restarting the group "
                f"(restart {self.restarts} of {c.max_restarts}): {again.reason}"
            ) from again
        lost = max(self.version - restored, 0)
        self.version = version
        return {
            "trainer_restarts": float(self.restarts),
            "restart_s": time.monotonic() - t0,
            "restored_version": float(restored),
            "lost_steps": float(lost),
        }

    # the Trainer protocol --------------------------------------------------------------------

    def train_step(self, batch: Sequence[Trajectory]) -> dict[str, float]:
        if not batch:
            raise TrainerError("train_step called with an empty batch")
        import ray

        ref = ray.put(list(batch))
        metrics, _ = self._call("train_step", lambda actors: [a.train_step.remote(ref) for a in actors])
        self.version += 1
        restart, self._pending_restart = self._pending_restart, {}
        return {**metrics, "version": float(self.version), **restart}

    def push_weights(self, version: int) -> dict[str, float]:
        """Push the current weights as ``version`` from rank 0 to the weight store (blocking)."""
        if self.weight_store is None:
            raise ConfigError("RayTrainerGroup.push_weights needs the weight_store the group was built with")
        metrics, restart = self._call(
            "push_weights", lambda actors: [a.push_weights.remote(version) for a in actors]
        )
        return {**metrics, **restart}

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Full tensors brought to the caller (tests, export); the pipeline pushes with :meth:`push_weights`."""
        weights, _ = self._call("full_weights", lambda actors: [a.full_weights.remote() for a in actors])
        self.weights_to_caller += 1
        return iter(weights.items())

    def logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """Logprob of each token given the previous ones under the current weights (first: none)."""
        ids = list(token_ids)
        out, _ = self._call("logprobs", lambda actors: [a.logprobs.remote(ids) for a in actors])
        return out

    def set_num_threads(self, n: int) -> None:
        if n < 1:
            raise TrainerError(f"set_num_threads: need at least 1 thread, got {n}")
        self._call("set_num_threads", lambda actors: [a.set_num_threads.remote(n) for a in actors])

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> None:
        """Checkpoint to ``path`` (written by rank 0: a path on a file system that node can write, and
        that every node can read for restarts)."""
        self._call("save", lambda actors: [a.save.remote(str(path), extra) for a in actors])

    def load(self, path: str | Path) -> None:
        """Continue from a checkpoint written by :meth:`save` (or the newest inside ``path``): every rank
        is rebuilt from it, at its version (``SupportsResume``)."""
        with self._serial:
            if self._closed:
                raise TrainerError("the trainer group is closed")
            ckpt = _newest_checkpoint(path, required=True)
            self._kill()
            try:
                self.resumed_state = self._build(ckpt, None)
            except _RankFailed as failure:
                self._lost = failure
                raise TrainerError(
                    f"trainer rank {failure.rank} failed while loading {ckpt}: {failure.reason}"
                ) from None
            self.version = int(self.resumed_state["version"])

    # introspection and shutdown --------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        """Process id of each rank's actor."""
        return list(self._pids)

    @property
    def node_ids(self) -> list[str]:
        """Ray node id of each rank."""
        return list(self._node_ids)

    def close(self) -> None:
        """Kill the rank actors and remove the placement group. Idempotent."""
        self._closed = True
        if self._actors:
            self._kill()
        if self._placement is not None:
            self._placement.remove()
            self._placement = None

    def __enter__(self) -> RayTrainerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _newest_checkpoint(path: str | Path | None, required: bool = False) -> Path | None:
    if path is None:
        return None
    try:
        return find_checkpoint(path)
    except TrainerError:
        if required:
            raise
        return None


def _checkpoint_version(ckpt: Path) -> int:
    return int(read_state(ckpt)["version"])
