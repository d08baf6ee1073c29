"""The refund decision of README.md's structured-answers example, shared by its tests and benchmark."""

from __future__ import annotations

from typing import Any

REFUND_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "refund": {"type": "boolean"},
        "damage": {"enum": ["none", "crushed", "wet", "torn"]},
        "reason": {"type": "string", "maxLength": 12},
    },
    "required": ["refund", "damage", "reason"],
    "additionalProperties": False,
}
