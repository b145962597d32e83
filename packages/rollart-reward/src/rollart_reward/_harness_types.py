"""The types of the sandbox's messages, for mypy only: :mod:`_harness` imports this module under its
``TYPE_CHECKING = False`` guard, so it is never copied into the sandbox nor imported there."""

from __future__ import annotations

from typing import Any, NotRequired, Required, TypedDict

Tagged = list[Any]  # a value as tagged data (_codec)


class Case(TypedDict, total=False):
    """A test case as the host sends it: ``kind`` says which of the other keys it has."""

    kind: Required[str]  # "call" (call, args, kwargs, expected), "script" (script), "io" (stdin, stdout)
    call: str
    args: Tagged
    kwargs: Tagged
    expected: Tagged
    script: str
    stdin: str
    stdout: str


class Config(TypedDict):
    """The run as the host sends it on stdin (plus ``audit_hook``, which the harness sets)."""

    nonce: str
    cases: list[Case]
    limits: dict[str, list[int]]  # resource.RLIMIT_* name -> [soft, hard]
    timeout_s: float
    max_output: int
    solution: str
    workdir: str
    env: dict[str, str]
    report_fd: int
    audit_hook: NotRequired[bool]


class Result(TypedDict, total=False):
    """One case's entry in the report."""

    passed: Required[bool]
    why: str
