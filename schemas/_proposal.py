"""What an agent host sends: the model's proposal and the trusted runtime context."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from pydantic import Field, WithJsonSchema

from schemas._base import WireModel
from schemas._subjects import TOKEN_PATTERN

__all__ = ["ARGUMENTS_SCHEMA", "PLAIN_TEXT_PATTERN", "RuntimeContext", "ToolProposal"]

PLAIN_TEXT_PATTERN = r"^[^\x00-\x1f\x7f]*$"
"""Text without control characters: what names and identifiers may hold. U+0000 in
particular is valid JSON that PostgreSQL's TEXT cannot store; one principal holding
it used to stop the operations view, and with it the relay, for every host."""

_Name = Annotated[str, Field(min_length=1, max_length=128, pattern=PLAIN_TEXT_PATTERN)]

ARGUMENTS_SCHEMA: dict[str, Any] = {
    "oneOf": [
        {
            "type": "object",
            "description": "The arguments object, as a model API that parses them gives it.",
        },
        {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {"type": "object"},
            "description": "The JSON text of the arguments object, exactly as the model API"
            " returned it (no need to parse or re-encode it).",
        },
    ]
}
"""What a proposal's `arguments` is on the wire: an object, or the JSON text of one.

The model itself takes any value there (the Python API is handed whatever a
model produced); the check's `parse` stage answers anything but an object with
a repairable finding (`json_syntax`, `not_an_object`, ...), never an error of
the message. The published schema names the two forms a host sends."""


def _now() -> datetime:
    return datetime.now(UTC)


class ToolProposal(WireModel):
    """A tool call a model proposed. Nothing has been checked or run yet.

    `arguments` is what the model produced: an object, or the raw JSON string
    most model APIs return. Parsing it is the check's first stage.
    """

    proposal_id: _Name
    conversation_id: _Name
    requested_by_user_id: _Name
    tool_name: str = Field(
        pattern=TOKEN_PATTERN,
        description="The tool the model chose ([A-Za-z0-9_-], at most 128): a tool name is a"
        " subject token, so a name that is not one can never be stored.",
    )
    arguments: Annotated[Any, WithJsonSchema(ARGUMENTS_SCHEMA)] = Field(
        description="The model's arguments as it produced them: a JSON object, or the JSON"
        " text of one. The check parses text itself; text that is not JSON, or JSON that is"
        " no object, is a repairable finding of the `parse` stage (`json_syntax`,"
        " `not_an_object`), not an error of the message. Idempotency compares the parsed"
        " arguments by their RFC 8785 canonical form, not their bytes: an object and its"
        " JSON text, in any key order or spacing, are the same arguments."
    )
    prompt_release: str = Field(default="unknown", max_length=128, pattern=PLAIN_TEXT_PATTERN)
    model_snapshot: str = Field(default="unknown", max_length=128, pattern=PLAIN_TEXT_PATTERN)
    created_at: datetime = Field(
        default_factory=_now,
        description="When the model proposed the call: an RFC 3339 date-time with its"
        " offset (the SDK writes UTC, `2026-11-29T10:00:00.402810Z`). Defaults to when the"
        " ledger received the proposal.",
    )
    operation_id: str | None = Field(
        default=None,
        pattern=TOKEN_PATTERN,
        description="Idempotency key chosen by the host ([A-Za-z0-9_-], at most 128);"
        " minted by opledger when absent.",
    )
    repair_attempt: int = Field(
        default=0,
        ge=0,
        description="Informational only: the ledger counts repairs itself (`repairs`), and"
        " this value neither exhausts nor extends the bound.",
    )
    repairs: str | None = Field(
        default=None,
        pattern=TOKEN_PATTERN,
        description="The host's operation ID of the rejected proposal this one repairs (same"
        " conversation and tool). The ledger counts the chain and refuses a repair past the"
        " contract's `max_repair_attempts` with `repair_exhausted`.",
    )


class RuntimeContext(WireModel):
    """Who is asking, established by the host's authentication, never by the model.

    Authorization reads only this; a model cannot widen it by writing
    `tenant_id` or `is_admin` into its arguments.
    """

    principal: _Name
    tenant: _Name
    capabilities: frozenset[_Name] = frozenset()
    environment: str = Field(default="development", max_length=64, pattern=PLAIN_TEXT_PATTERN)
