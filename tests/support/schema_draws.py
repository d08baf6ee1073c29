"""Hypothesis strategies for JSON Schemas, and a random walk through a compiled grammar.

`supported` draws schemas the decoder enforces as they are (objects, arrays, enums, bounded strings,
integer ranges, booleans, nesting). `wide` draws beyond them, on purpose: `pattern`, `$ref` (recursive
ones too), `anyOf`, `const`, `prefixItems`, exclusive and fractional bounds, and sibling keywords the
decoder may drop (a bound with no `type`, `maxLength` beside `pattern` or `enum`, `type` beside `$ref`).
The property every such schema must have: refused at submission, or every answer validates.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from hypothesis import strategies as st

from workers.engine import masks

WORDS = ["refund", "replace", "no_action", "wet", "crushed"]
_names = st.sampled_from(["refund", "damage", "carrier", "count", "note", "ok"])
# Patterns that some string matches (a pattern that matches nothing is a dead end found at run time).
PATTERNS = [
    "^[a-z]{1,5}$",
    "[0-9]+",
    "ab?c",
    "^(yes|no)$",
    "x*",
    "^[A-Z][a-z]{0,3}$",
    "^T-[0-9]{2,4}$",
    "^\\w{2}$",
    "^[\u00e0-\u00ff]{1,2}$",
    # ...and some the decoder cannot enforce (refused at submission): the property still holds
    '^"$',
    "^a.$",
    "^[^a]$",
    "^\\s$",
    "(?i)^a$",
]

_leaf = st.one_of(
    st.just({"type": "boolean"}),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50), st.integers(0, 200),
    ),
    st.builds(
        lambda lo, span: {"type": "string", "minLength": lo, "maxLength": lo + span},
        st.integers(0, 3), st.integers(0, 6),
    ),
    st.builds(
        lambda words: {"enum": words},
        st.lists(st.sampled_from(WORDS), min_size=1, max_size=4, unique=True),
    ),
)  # fmt: skip


def _object(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    def build(props: dict[str, Any], required_all: bool) -> dict[str, Any]:
        schema = {"type": "object", "properties": props, "additionalProperties": False}
        return {**schema, "required": sorted(props)} if required_all else schema

    return st.builds(build, st.dictionaries(_names, children, min_size=1, max_size=3), st.booleans())


def _array(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        lambda item, lo, span: {"type": "array", "items": item, "minItems": lo, "maxItems": lo + span},
        children, st.integers(0, 2), st.integers(0, 2),
    )  # fmt: skip


supported = st.recursive(_leaf, lambda inner: st.one_of(_object(inner), _array(inner)), max_leaves=6)

# ------------------------------------------------------------------ beyond the plain subset
_numbers = st.one_of(st.integers(-20, 20), st.sampled_from([-1.5, 0.25, 2.5, 7.0]))
_wide_leaf = st.one_of(
    _leaf,
    st.builds(lambda p: {"type": "string", "pattern": p}, st.sampled_from(PATTERNS)),
    st.builds(
        lambda kind, low, high, lo_key, hi_key: {"type": kind, lo_key: low, hi_key: high},
        st.sampled_from(["integer", "number"]), _numbers, _numbers,
        st.sampled_from(["minimum", "exclusiveMinimum"]), st.sampled_from(["maximum", "exclusiveMaximum"]),
    ),
    st.builds(lambda v: {"const": v}, st.one_of(st.sampled_from(WORDS), st.integers(-3, 3), st.booleans())),
    st.just({"type": "null"}),
)  # fmt: skip

# Keywords a schema may carry beside its own: some the decoder enforces there, some it would drop.
_SIBLINGS: list[dict[str, Any]] = [
    {"maxLength": 2}, {"minLength": 1}, {"minimum": 0}, {"exclusiveMaximum": 5}, {"maxItems": 1},
    {"type": "string"}, {"type": "integer"}, {"type": ["string", "null"]}, {"title": "a note"},
    {"description": "\u00e9t\u00e9 \U0001f4e6"},
]  # fmt: skip


def _with_sibling(schema: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.builds(
        lambda base, extra: {**base, **extra} if isinstance(base, dict) else base,
        schema, st.sampled_from(_SIBLINGS),
    )  # fmt: skip


def _any_of(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda branches: {"anyOf": branches}, st.lists(children, min_size=1, max_size=3))


def _prefix(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    def build(first: list[Any], rest: Any, lo: int, span: int | None) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "array", "prefixItems": first, "minItems": lo}
        if rest is not None:
            schema["items"] = rest
        if span is not None:
            schema["maxItems"] = lo + span
        return schema

    return st.builds(
        build, st.lists(children, min_size=1, max_size=3), st.one_of(st.none(), st.just(False), children),
        st.integers(0, 3), st.one_of(st.none(), st.integers(0, 3)),
    )  # fmt: skip


def _referenced(children: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A schema moved into $defs and referenced (with a sibling at times); or a recursive list."""
    plain = st.builds(lambda sub: {"$defs": {"a": sub}, "$ref": "#/$defs/a"}, children)
    node = {
        "type": "object",
        "properties": {"next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["next"],
        "additionalProperties": False,
    }
    recursive = st.just({"$defs": {"node": node}, "$ref": "#/$defs/node"})
    return st.one_of(plain, _with_sibling(plain), recursive)


def hoist(schema: Any) -> Any:
    """Every nested `$defs` moved to the root under a name of its own, the references inside its
    subtree renamed to match: references resolve from the root, so a drawn sub-schema's own `$defs`
    would otherwise point at nothing."""
    root_defs: dict[str, Any] = {}

    def visit(node: Any, renames: dict[str, str]) -> Any:
        if isinstance(node, list):
            return [visit(item, renames) for item in node]
        if not isinstance(node, dict):
            return node
        node = dict(node)
        if isinstance(node.get("$defs"), dict):
            local = {}
            for name in node["$defs"]:
                local[name] = f"d{len(root_defs)}"
                root_defs[local[name]] = None  # reserved: nested defs take other names
            renames = {**renames, **{f"#/$defs/{old}": f"#/$defs/{new}" for old, new in local.items()}}
            for old, sub in node.pop("$defs").items():
                root_defs[local[old]] = visit(sub, renames)
        if isinstance(node.get("$ref"), str):
            node["$ref"] = renames.get(node["$ref"], node["$ref"])
        return {key: value if key == "$ref" else visit(value, renames) for key, value in node.items()}

    body = visit(schema, {})
    if not root_defs or not isinstance(body, dict):
        return body
    return {**body, "$defs": root_defs}


wide = st.recursive(
    st.one_of(_wide_leaf, _with_sibling(_wide_leaf)),
    lambda inner: st.one_of(
        _object(inner), _array(inner), _any_of(inner), _prefix(inner), _referenced(inner)
    ),
    max_leaves=5,
).map(hoist)


def walk(
    grammars: Any, constraint: Any, eos_id: int, rng: random.Random, closers: set[int], limit: int = 160
) -> list[int] | None:
    """One answer of the grammar drawn at random (tokens allowed by the engine's own mask for the row,
    end-of-text taken half the time it is allowed, closing tokens preferred now and then so answers
    end): its tokens, or None when `limit` tokens did not finish it. AssertionError at a dead end."""
    tokens: list[int] = []
    for _ in range(limit):
        # What the engine's mask leaves finite of a row of logits (xgrammar.testing's bitmask_to_bool_mask
        # tests a bit a token in Python: most of this test's CPU, for the same set)
        logits = masks.apply(torch.zeros(1, grammars.vocab_size), masks.for_rows([constraint]))
        allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
        assert allowed, f"the grammar reached a dead end after {len(tokens)} tokens"
        if eos_id in allowed and rng.random() < 0.5:
            return tokens
        preferred = [t for t in allowed if t in closers]
        token = rng.choice(preferred) if preferred and rng.random() < 0.3 else rng.choice(allowed)
        if token == eos_id:
            return tokens
        constraint.accept(token)
        tokens.append(token)
    return None
