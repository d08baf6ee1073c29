"""What the structured-answer decoder enforces of a JSON Schema, checked without torch.

The worker turns a schema into a grammar (xgrammar 0.2.9, workers/grammar.py). Where the grammar
would silently drop a keyword, the answer could break the schema the caller asked for; where it
cannot be compiled, or allows no answer at all, the job could only fail on the worker. Each such
schema is refused here, at submission, by name and place. Every rule below was found by probing the
grammar library with strings that break the keyword (tests/unit/test_schema_rules.py keeps them):

- keywords outside ENFORCED are refused (`oneOf`, `not`, `format`...);
- `$ref` and `anyOf` are enforced alone: any sibling but annotations and `$defs` is dropped;
- `enum`/`const` are enforced alone too, so a sibling is accepted only when every listed value
  satisfies it anyway (`{"type": "string", "enum": ["a", "b"]}`), and refused otherwise;
- bounds (`minLength`, `maxLength`, `pattern`, `minimum`..., `minItems`, `maxItems`) are dropped
  without a `type`; `pattern` drops `minLength`/`maxLength` beside it;
- what cannot compile is refused as unsatisfiable (minimum above maximum, fractional bounds of an
  integer, more `prefixItems` than `maxItems`, `minItems` past `prefixItems` with no `items`);
- a schema with no finite answer (a `$ref` cycle with no way out, a required property or item that
  allows nothing, an empty `enum`) is refused: the decoder would reach a dead end.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

from shared import pattern_match, pattern_rules, schema_values

ENFORCED = frozenset(
    {
        "type", "enum", "const", "anyOf", "$ref", "$defs", "definitions",
        "properties", "required", "additionalProperties",
        "items", "prefixItems", "minItems", "maxItems",
        "minLength", "maxLength", "pattern",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    }
)  # fmt: skip
# Words that say something to people and nothing to a validator.
ANNOTATIONS = frozenset(
    {"$schema", "$id", "$comment", "title", "description", "default", "examples", "deprecated",
     "readOnly", "writeOnly"}
)  # fmt: skip
_MAPS = ("properties", "$defs", "definitions")
_LISTS = ("anyOf", "prefixItems")
_ONE = ("items", "additionalProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_STRING_BOUNDS = ("minLength", "maxLength", "pattern")
_ARRAY_BOUNDS = ("minItems", "maxItems")
# Keywords beside which nothing but these is enforced.
_ALONE = ("$ref", "anyOf")
_BESIDE_ALONE = ANNOTATIONS | {"$defs", "definitions"}


def problem(schema: dict[str, Any]) -> str | None:
    """Why the decoder cannot enforce this (valid) schema, or None."""
    return _first(_node_problem(node, where) for node, where in nodes(schema, "")) or _finite_problem(schema)


def nodes(schema: object, path: str) -> Iterator[tuple[dict[str, Any], str]]:
    """Every subschema that is an object, with its place (iterative: no recursion limit to hit)."""
    stack = [(schema, path)]
    while stack:
        node, where = stack.pop()
        if not isinstance(node, dict):
            continue  # true / false: valid subschemas, enforced as they are
        yield node, where or "/"
        children: list[tuple[object, str]] = []
        for key in _MAPS:
            if isinstance(node.get(key), dict):
                children += [(sub, f"{where}/{key}/{name}") for name, sub in node[key].items()]
        for key in _LISTS:
            if isinstance(node.get(key), list):
                children += [(sub, f"{where}/{key}/{i}") for i, sub in enumerate(node[key])]
        children += [(node[key], f"{where}/{key}") for key in _ONE if key in node]
        stack.extend(reversed(children))


def _node_problem(node: dict[str, Any], where: str) -> str | None:
    for key in node:
        if key not in ENFORCED and key not in ANNOTATIONS:
            return f"at {_at(where, key)}: {key!r} is not enforced by the decoder; supported: {supported()}"
    return (
        _keyword_forms(node, where)
        or _false_problem(node, where)
        or _pattern_problem(node, where)
        or schema_values.node_problem(node, where)
        or _alone_problem(node, where)
        or _listed_values_problem(node, where)
        or _typed_bounds_problem(node, where)
        or _unsatisfiable(node, where)
    )


def _keyword_forms(node: dict[str, Any], where: str) -> str | None:
    ref = node.get("$ref")
    if ref is not None and not str(ref).startswith("#"):
        return f"at {_at(where, '$ref')}: only local references (#/...) are followed, never fetched"
    for key in _NUMBERS:
        if isinstance(node.get(key), bool):
            return _refuse(
                where, key, "the draft-04 boolean form is not supported; give the bound as a number"
            )
    if isinstance(node.get("items"), list):
        return _refuse(
            where, "items", "a list of item schemas (draft-07 tuples) is not supported; use prefixItems"
        )
    listed = node.get("properties", {})
    missing = [name for name in node.get("required", []) if name not in listed]
    if missing:
        return (
            f"at {_at(where, 'required')}: {missing[0]!r} is required but not in properties, so it cannot be "
            "generated"
        )
    return None


def _false_problem(node: dict[str, Any], where: str) -> str | None:
    """`false` (no value at all) is enforced as `items` and `additionalProperties` only; anywhere else
    the grammar does not compile (a property, a prefix item, a branch, a definition)."""
    places = [(f"properties/{k}", v) for k, v in (node.get("properties") or {}).items()]
    places += [(f"prefixItems/{i}", v) for i, v in enumerate(node.get("prefixItems") or [])]
    places += [(f"anyOf/{i}", v) for i, v in enumerate(node.get("anyOf") or [])]
    for key in ("$defs", "definitions"):
        places += [(f"{key}/{k}", v) for k, v in (node.get(key) or {}).items()]
    for place, sub in places:
        if sub is False:
            return _refuse(where, place, "a schema of 'false' allows nothing; leave it out")
    return None


def _pattern_problem(node: dict[str, Any], where: str) -> str | None:
    pattern = node.get("pattern")
    found = pattern_rules.problem(pattern) if isinstance(pattern, str) else None
    return _refuse(where, "pattern", found) if found else None


def _alone_problem(node: dict[str, Any], where: str) -> str | None:
    for key in _ALONE:
        if key in node:
            beside = sorted(k for k in node if k != key and k not in _BESIDE_ALONE)
            if beside:
                into = "the referenced schema" if key == "$ref" else "each branch"
                return _refuse(
                    where, beside[0], f"{beside[0]!r} beside {key!r} is not enforced by the decoder (it "
                    f"enforces {key!r} alone); move it into {into}",
                )  # fmt: skip
    return None


def _listed_values_problem(node: dict[str, Any], where: str) -> str | None:
    """enum/const are enforced alone: keywords beside them are accepted only where every listed value
    satisfies them anyway (then the grammar's answers are exactly the valid ones)."""
    if "enum" in node and "const" in node:
        return f"at {_at(where, 'const')}: give either enum or const, not both"
    key = "enum" if "enum" in node else "const" if "const" in node else None
    if key is None:
        return None
    values = node["enum"] if key == "enum" else [node["const"]]
    if not values:
        return f"at {_at(where, 'enum')}: an empty enum allows no answer"
    rest = {k: v for k, v in node.items() if k not in (key, *_BESIDE_ALONE)}
    if not rest:
        return None
    validator = pattern_match.validator(rest)  # a `pattern` beside: bounded time (re backtracks)
    for value in values:
        try:
            fits = validator.is_valid(value)
        except pattern_match.PatternTooCostly as exc:
            return _refuse(where, key, f"the values cannot be checked against the pattern beside: {exc}")
        if not fits:
            return _refuse(
                where, key, f"the value {_short(value)} breaks {sorted(rest)[0]!r} beside it, which the "
                f"decoder does not enforce beside {key!r}; list only values that fit",
            )  # fmt: skip
    return None


def _types(node: dict[str, Any]) -> set[str]:
    declared = node.get("type")
    return {declared} if isinstance(declared, str) else set(declared or ())


def _typed_bounds_problem(node: dict[str, Any], where: str) -> str | None:
    if "enum" in node or "const" in node:
        return None  # checked against every listed value instead
    types = _types(node)
    for key in (*_STRING_BOUNDS, *_NUMBERS, *_ARRAY_BOUNDS):
        if key in node and not types:
            return f"at {_at(where, key)}: {key!r} is enforced only beside a 'type'; add one"
    if "pattern" in node and ("minLength" in node or "maxLength" in node):
        key = "minLength" if "minLength" in node else "maxLength"
        return _refuse(
            where,
            key,
            f"{key!r} beside 'pattern' is not enforced by the decoder; put the length in the pattern",
        )
    if "integer" in types:
        for key in _NUMBERS:
            value = node.get(key)
            if isinstance(value, float) and not value.is_integer():
                return f"at {_at(where, key)}: an integer's bound must be a whole number, got {value}"
    return None


def _unsatisfiable(node: dict[str, Any], where: str) -> str | None:
    """Bounds that contradict each other: no answer exists (the grammar does not compile)."""
    pairs = (("minimum", "maximum"), ("minLength", "maxLength"), ("minItems", "maxItems"))
    for low, high in pairs:
        if _number(node, low) and _number(node, high) and node[low] > node[high]:
            return _refuse(where, low, f"{low} {node[low]} is above {high} {node[high]}: no answer fits")
    lowest, highest = _lowest(node), _highest(node)
    whole = "number" not in _types(node) and "integer" in _types(node)
    if lowest is not None and highest is not None and _empty_range(lowest, highest, whole):
        return f"at {where}: the numeric bounds leave no value between them"
    prefix = node.get("prefixItems")
    if isinstance(prefix, list):
        if isinstance(node.get("maxItems"), int) and node["maxItems"] < len(prefix):
            return _refuse(
                where, "maxItems", f"maxItems {node['maxItems']} is below the {len(prefix)} prefixItems"
            )
        extra = node.get("items", False)
        if isinstance(node.get("minItems"), int) and node["minItems"] > len(prefix) and extra is False:
            return _refuse(
                where, "minItems", f"minItems {node['minItems']} is past the {len(prefix)} prefixItems and "
                "no 'items' schema says what the rest are (the decoder generates no other items)",
            )  # fmt: skip
    return None


def _empty_range(low: tuple[float, bool], high: tuple[float, bool], whole: bool) -> bool:
    if whole:  # the integers inside the bounds
        first = math.floor(low[0]) + 1 if low[1] else math.ceil(low[0])
        last = math.ceil(high[0]) - 1 if high[1] else math.floor(high[0])
        return first > last
    return low[0] > high[0] or (low[0] == high[0] and (low[1] or high[1]))


def _lowest(node: dict[str, Any]) -> tuple[float, bool] | None:
    """The lower bound and whether it is exclusive."""
    found = [
        (float(node[k]), k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum") if _number(node, k)
    ]
    return max(found, key=lambda b: (b[0], b[1])) if found else None


def _highest(node: dict[str, Any]) -> tuple[float, bool] | None:
    found = [
        (float(node[k]), k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum") if _number(node, k)
    ]
    return min(found, key=lambda b: (b[0], not b[1])) if found else None


def _number(node: dict[str, Any], key: str) -> bool:
    value = node.get(key)
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# ------------------------------------------------------------------ a finite answer exists
def _finite_problem(schema: dict[str, Any]) -> str | None:
    """A least fixpoint over the local references: a subschema is finite when some answer of it can
    be written out. None when the root is."""
    targets: dict[str, Any] = {}
    for node, where in nodes(schema, ""):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in targets:
            target = resolve(schema, ref)
            if target is NOWHERE:
                return f"at {_at(where, '$ref')}: {ref[:80]!r} points at nothing in this schema"
            targets[ref] = target
    cycle = _bare_cycle(targets)
    if cycle:
        return f"at /: the $ref chain {cycle} comes back to itself with nothing between: it has no answer"
    finite: set[str] = set()
    changed = True
    while changed:
        changed = False
        for ref, target in targets.items():
            if ref not in finite and _finite(target, finite):
                finite.add(ref)
                changed = True
    if _finite(schema, finite):
        return None
    return (
        "at /: the schema allows no finite answer (a $ref cycle with no way out, an empty enum, or a "
        "required property or item that allows nothing): the decoder would reach a dead end"
    )


NOWHERE = object()


def _bare_cycle(targets: dict[str, Any]) -> str | None:
    """A chain of references that each point at a bare reference and come back (a -> b -> a): the
    grammar cannot compile it even where an anyOf around it has a way out."""
    for start in targets:
        seen = [start]
        node = targets[start]
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"] in targets:
            ref = node["$ref"]
            if ref in seen:
                return " -> ".join([*seen, ref])[:200]
            seen.append(ref)
            node = targets[ref]
    return None


# A JSON pointer's array index (RFC 6901): ASCII digits, no leading zero. str.isdigit took "٣", which
# the worker's grammar library refused after the job was queued, and "²", which int() refused with
# Python's own words (review, helper-90); no schema's array is longer than 18 digits can count.
_INDEX = re.compile(r"0|[1-9][0-9]{0,17}")


def resolve(root: dict[str, Any], ref: str) -> Any:
    """A local reference (`#`, `#/$defs/a`, any JSON pointer) to the subschema it names."""
    pointer = unquote(ref.removeprefix("#"))
    node: Any = root
    for part in filter(None, pointer.split("/")):
        name = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and name in node:
            node = node[name]
        elif isinstance(node, list) and _INDEX.fullmatch(name) and int(name) < len(node):
            node = node[int(name)]
        else:
            return NOWHERE
    return node


def _finite(node: object, finite: set[str], depth: int = 0) -> bool:
    if depth > 200:  # deeper than any schema the size limit lets through: not provably finite
        return False
    if node is True or node is None:
        return True
    if node is False or not isinstance(node, dict):
        return False
    if "$ref" in node:
        return str(node["$ref"]) in finite
    if "enum" in node:
        return bool(node["enum"])
    if "anyOf" in node:
        return any(_finite(branch, finite, depth + 1) for branch in node["anyOf"])
    properties = node.get("properties", {})
    if any(not _finite(properties.get(name), finite, depth + 1) for name in node.get("required", [])):
        return False
    if "array" in _types(node) or "items" in node or "prefixItems" in node:
        least = node.get("minItems", 0) if isinstance(node.get("minItems"), int) else 0
        prefix = node.get("prefixItems", []) if isinstance(node.get("prefixItems"), list) else []
        needed = prefix[:least]
        if least > len(prefix):
            needed = [*needed, node.get("items", True)]
        return all(_finite(item, finite, depth + 1) for item in needed)
    return True


def _at(where: str, key: str) -> str:
    return f"{where.rstrip('/')}/{key}"


def _refuse(where: str, key: str, why: str) -> str:
    return f"at {_at(where, key)}: {why}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _first(problems: Iterator[str | None]) -> str | None:
    return next((p for p in problems if p), None)


def supported() -> str:
    return ", ".join(sorted(ENFORCED))
