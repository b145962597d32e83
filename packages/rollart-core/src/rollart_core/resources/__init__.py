"""The resource plane (R1): where every worker runs.

- :mod:`.affinity` — ``@affinity(...)`` records a frozen :class:`AffinitySpec` on a class (no Ray);
- :mod:`.placement` — named pools over a heterogeneous Ray cluster, plan validation (:func:`validate_plan`),
  placement groups (:func:`place`, :class:`ResourceManager`);
- :mod:`.cluster` — :class:`RayCluster`: start or join the run's Ray cluster, kept on loopback.

Ray is imported only inside the functions that talk to a cluster.
"""

from rollart_core.resources.affinity import AffinitySpec, affinity, get_affinity, ray_actor_options
from rollart_core.resources.cluster import LOOPBACK_ENV, RayCluster, worker_logs_to
from rollart_core.resources.placement import (
    ClusterView,
    Placement,
    PlacementError,
    ResourceManager,
    ResourcePlanConfig,
    ServerlessPoolConfig,
    TaskAffinity,
    WorkerDecl,
    place,
    validate_plan,
)

__all__ = [
    # affinity
    "AffinitySpec",
    "affinity",
    "get_affinity",
    "ray_actor_options",
    # placement
    "ClusterView",
    "Placement",
    "PlacementError",
    "ResourceManager",
    "ResourcePlanConfig",
    "ServerlessPoolConfig",
    "TaskAffinity",
    "WorkerDecl",
    "place",
    "validate_plan",
    # cluster
    "LOOPBACK_ENV",
    "RayCluster",
    "worker_logs_to",
]
