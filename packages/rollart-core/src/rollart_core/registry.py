"""Find implementations by name (entry points) or by ``"package.module:Class"`` path, lazily.

Groups: ``rollart.engine``, ``rollart.env``, ``rollart.reward``, ``rollart.trainer``,
``rollart.weight_store``, ``rollart.proxy``. A member package registers its implementations in
its ``pyproject.toml``; nothing is imported until it is chosen.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any, TypeVar, overload

from pydantic import BaseModel, ValidationError

from rollart_core.errors import ConfigError, MissingExtraError, RegistryError, validation_details

__all__ = ["GROUPS", "available", "build", "check", "resolve", "validate_options"]

GROUPS = ("engine", "env", "env_manager", "reward", "reward_executor", "trainer", "weight_store", "proxy")
T = TypeVar("T")


_ENTRY_POINTS: dict[str, dict[str, Any]] = {}
"""Per group, name -> entry point. Scanning the installed distributions costs ~5 ms, and ``build``
runs per environment (a pipeline builds one per trajectory, an env actor one per respawned
replica), so the scan is done once per group and again only when a name is not found (a package
installed since)."""


def _entry_points(group: str, refresh: bool = False) -> dict[str, Any]:
    if refresh or group not in _ENTRY_POINTS:
        eps: dict[str, Any] = {}
        for ep in entry_points(group=f"rollart.{group}"):
            eps.setdefault(ep.name, ep)
        _ENTRY_POINTS[group] = eps
    return _ENTRY_POINTS[group]


def available(group: str) -> list[str]:
    """Names registered in ``rollart.<group>`` by the installed packages."""
    return sorted(_entry_points(group, refresh=True))


def resolve(group: str, name: str) -> Any:
    """Return the object named ``name`` in ``group`` (or at the ``module:attr`` path)."""
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except MissingExtraError:
            raise
        except ImportError as exc:
            raise RegistryError(f"cannot import {module_name!r} for {group} {name!r}: {exc}") from exc
        try:
            return getattr(module, attr)
        except AttributeError:
            raise RegistryError(f"module {module_name!r} has no attribute {attr!r}") from None
    ep = _entry_points(group).get(name) or _entry_points(group, refresh=True).get(name)
    if ep is None:
        known = ", ".join(available(group)) or "none installed"
        raise RegistryError(
            f"unknown {group} implementation {name!r} (known: {known}; or give 'package.module:Class')"
        )
    return ep.load()


def validate_options(cls: Any, options: dict[str, Any], where: str) -> BaseModel | None:
    """Validate ``options`` with ``cls.Config`` (a pydantic model) if the class declares one."""
    config_cls = getattr(cls, "Config", None)
    if config_cls is None:
        if options:
            raise ConfigError(f"{where}: {cls.__name__} takes no options, got {sorted(options)}")
        return None
    try:
        return config_cls.model_validate(options)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc, prefix=where)) from None


def check(group: str, impl: str, options: dict[str, Any], where: str) -> BaseModel | None:
    """Resolve ``impl``, validate its options and, if its class implements
    :class:`~rollart_core.protocols.SupportsConfigCheck`, run its ``check_config`` (a ConfigError it
    raises is prefixed with ``where``). Builds nothing; returns the validated options."""
    from rollart_core.protocols import SupportsConfigCheck

    cls = resolve(group, impl)
    cfg = validate_options(cls, options, where)
    if cfg is not None and isinstance(cls, SupportsConfigCheck):
        try:
            cls.check_config(cfg)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from exc
    return cfg


@overload
def build(
    group: str, impl: str, options: dict[str, Any], where: str, *, protocol: type[T], **kwargs: Any
) -> T: ...
@overload
def build(
    group: str, impl: str, options: dict[str, Any], where: str, *, protocol: None = None, **kwargs: Any
) -> Any: ...
def build(
    group: str,
    impl: str,
    options: dict[str, Any],
    where: str,
    *,
    protocol: type[Any] | None = None,
    **kwargs: Any,
) -> Any:
    """Resolve ``impl`` in ``group``, validate its options, and construct it. ``protocol`` (a
    runtime-checkable Protocol): the object must implement it (RegistryError naming what is missing)."""
    cls = resolve(group, impl)
    cfg = validate_options(cls, options, where)
    obj = cls(cfg, **kwargs) if cfg is not None else cls(**kwargs)
    if protocol is not None and not isinstance(obj, protocol):
        wanted = {n for n in vars(protocol) if not n.startswith("_")} | set(
            getattr(protocol, "__annotations__", {})
        )
        missing = [m for m in wanted if not hasattr(obj, m)]
        raise RegistryError(
            f"{group} {impl!r} ({type(obj).__name__}) does not implement {protocol.__name__}"
            + (f" (missing: {', '.join(sorted(missing))})" if missing else "")
        )
    return obj


def _format_validation(exc: ValidationError, prefix: str = "") -> str:
    return "invalid configuration:\n" + "\n".join(f"  {line}" for line in validation_details(exc, prefix))
