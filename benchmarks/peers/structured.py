"""The structured workload: support emails to turn into a ticket, as JSON that must follow a
schema (`response_format` `json_schema`), the grammar enforced by llguidance on both servers.

The schema is what an extraction pipeline asks for: a nested object, enums, an array of
objects, bounded strings and numbers, every field required. The prompts are a handful of
emails, cycled over the run in an order fixed by the seed. Each run's share of replies
that parse and validate against the schema is reported beside its latencies.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "maxLength": 60},
                "plan": {"enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "email", "plan"],
            "additionalProperties": False,
        },
        "category": {"enum": ["billing", "bug", "feature_request", "account", "shipping"]},
        "priority": {"enum": ["low", "medium", "high", "urgent"]},
        "summary": {"type": "string", "maxLength": 160},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "product": {"type": "string", "maxLength": 40},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                },
                "required": ["product", "quantity"],
                "additionalProperties": False,
            },
            "maxItems": 4,
        },
        "refund_requested": {"type": "boolean"},
    },
    "required": ["customer", "category", "priority", "summary", "items", "refund_requested"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "support_ticket", "schema": SCHEMA, "strict": True},
}

_ASK = (
    "Turn this customer email into a support ticket. Reply with JSON only: the customer "
    "(name, email, plan), the category, the priority, a one-sentence summary, the items "
    "concerned (product and quantity) and whether a refund is requested.\n\nEmail:\n"
)
EMAILS = [
    "From: Maria Lopez <maria.lopez@example.com>\nI am on the Pro plan and was charged twice "
    "for March. Please refund the duplicate payment as soon as possible.",
    "From: Tom Becker <tbecker@example.org>\nThe export button crashes the desktop app every "
    "time I click it since yesterday's update. We have 12 seats on Enterprise and the whole "
    "team is blocked.",
    "From: Aiko Tanaka <aiko@example.net>\nI ordered 2 USB-C docks and 1 monitor stand three "
    "weeks ago and nothing has arrived. Tracking has not moved. Free account.",
    "From: Samuel Okafor <s.okafor@example.com>\nCould you add dark mode to the web "
    "dashboard? Not urgent, just a wish from a happy Pro customer.",
    "From: Priya Nair <priya.nair@example.com>\nI cannot log in: the password reset email "
    "never comes. I need access today for a client demo. Enterprise plan.",
    "From: Lucas Martin <lucas@example.fr>\nTwo of the five keyboards I received have broken "
    "keys. I would like a refund for those two. I use the free plan.",
]


def prompts() -> list[str]:
    return [_ASK + email for email in EMAILS]


def write_dataset(num_prompts: int, seed: int, path: Path) -> Path:
    """`num_prompts` requests, the emails cycled, in an order fixed by `seed`, as `vllm bench
    serve --dataset-name custom` reads them (one `{"prompt": ...}` a line)."""
    texts = prompts()
    rows = [texts[i % len(texts)] for i in range(num_prompts)]
    random.Random(seed).shuffle(rows)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    return path


def valid_fraction(texts: list[str], errors: list[str] | None = None,
                   total: int | None = None) -> float:
    """The share of `total` requests (default: every text) whose reply parses as JSON and
    validates against SCHEMA; a failed request counts as invalid."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(SCHEMA)
    errors = errors or [""] * len(texts)
    valid = sum(not error and validator.is_valid(_parsed(text))
                for text, error in zip(texts, errors, strict=False))
    total = len(texts) if total is None else total
    return valid / total if total else 0.0


def _parsed(text: str) -> Any:
    """The JSON value of `text`; a value no object schema accepts when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return _NOT_JSON


_NOT_JSON = float("nan")
