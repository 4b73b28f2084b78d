"""What the check needs from the outside world, as small protocols the host supplies."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from schemas import RuntimeContext, ValidationIssue

__all__ = [
    "AmbiguousTarget",
    "BudgetCounter",
    "SemanticInput",
    "SemanticRule",
    "Target",
    "TargetResolver",
]


@dataclass(frozen=True, slots=True)
class Target:
    """A resource an argument names, as the host's own systems see it."""

    kind: str
    id: str
    tenant: str
    owner: str | None = None
    source_id: str | None = None
    version: str | None = None
    attributes: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AmbiguousTarget:
    """More than one resource answers to the reference (a customer record kept twice)."""

    kind: str
    id: str
    matches: tuple[Target, ...]


class TargetResolver(Protocol):
    """Looks a target up in the host's systems. Returns None when it does not exist,
    and `AmbiguousTarget` when several resources answer to it."""

    def resolve(
        self, kind: str, target_id: str, context: RuntimeContext
    ) -> Target | AmbiguousTarget | None:
        """The target of `kind` with `target_id`, all of them if several, or None."""
        ...


class BudgetCounter(Protocol):
    """Counts operations already proposed, for rate limits that hold across restarts."""

    def count(self, *, tenant: str, actor: str, tool: str, since: datetime) -> int:
        """How many operations `actor` in `tenant` proposed for `tool` since `since`."""
        ...


@dataclass(frozen=True, slots=True)
class SemanticInput:
    """What a per-tool semantic rule sees: normalized arguments, context, resolved targets."""

    tool: str
    arguments: Mapping[str, Any]
    context: RuntimeContext
    targets: Mapping[str, Target]
    now: datetime


SemanticRule = Callable[[SemanticInput], Iterable[ValidationIssue]]
"""A cross-field rule of one tool: returns the issues it finds (none when satisfied)."""
