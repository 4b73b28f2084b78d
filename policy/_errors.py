"""The errors of `policy`: every one an `OpledgerError`, re-exported from `policy`.

Each is also a `ValueError`, as the plain errors it replaces were, so that
callers catching `ValueError` keep working.
"""

from __future__ import annotations

from schemas import ErrorCategory, OpledgerError

__all__ = ["ArgumentLimitsError", "ContractError", "ToolFormatError"]


class ContractError(OpledgerError, ValueError):
    """A contract file is invalid. `source` and `pointer` say where."""

    category = ErrorCategory.INVALID_INPUT
    code = "INVALID_CONTRACT"

    def __init__(self, message: str, *, source: str = "", pointer: str = "") -> None:
        self.source = source
        self.pointer = pointer
        where = ":".join(part for part in (source, pointer) if part)
        super().__init__(f"{where}: {message}" if where else message, pointer=pointer)


class ToolFormatError(OpledgerError, ValueError):
    """`export_tool` was asked for a format it does not render."""

    category = ErrorCategory.INVALID_INPUT
    code = "UNKNOWN_TOOL_FORMAT"


class ArgumentLimitsError(OpledgerError, ValueError):
    """`ArgumentLimits` were given a limit that is not positive."""

    category = ErrorCategory.INVALID_INPUT
    code = "INVALID_ARGUMENT_LIMITS"
