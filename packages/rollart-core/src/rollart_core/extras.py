"""Import guards for optional back-ends: a missing extra names the exact install command."""

from __future__ import annotations

import importlib
from types import ModuleType

from rollart_core.errors import MissingExtraError

__all__ = ["require"]


def require(module: str, install: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` telling the user to run ``install``.

    >>> require("json", "pip install json")  # doctest: +ELLIPSIS
    <module 'json' ...>
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        # Only translate "the module itself is absent"; a broken install of a present module
        # must surface with its own traceback.
        missing = getattr(exc, "name", None)
        if missing is None or not (module == missing or module.startswith(missing + ".")):
            raise
        raise MissingExtraError(f"{module!r} is not installed. Install it with: {install}") from exc
