"""JSON schemas of tool parameters, compiled into the small table the tool-call grammar walks.

Contract: `SchemaTable.add(schema)` compiles one (sub)schema and returns a node id; node 0 is
`ANY` (any JSON value). Only what constrained decoding can enforce cheaply is kept:

* `kinds`: the JSON kinds a value may take, from `type` (string or list), the members of
  `anyOf`/`oneOf`, else the kinds of the `enum`/`const` values; all kinds when the schema says
  none. `declared` is that same set when the schema states it, else empty (the qwen3_5 format
  reads a parameter as free text unless the declared kinds exclude "string", as the parser does).
* `enum` / `const`: the value must be one of them, written as `json.dumps(v, ensure_ascii=False)`.
* objects: `properties`, `required`, and whether the keys are closed: closed when
  `additionalProperties` is false, or when `properties` is non-empty and `additionalProperties` is
  absent/null. A closed object's keys are `properties` plus `required`; an open object takes any
  key (a dict `additionalProperties` types the values of an open object that lists no properties).
* arrays: `items` (a dict) and `maxItems`; strings: `maxLength`.

Everything else (`$ref`, `allOf`, `pattern`, `minimum`, member schemas of `anyOf`, ...) is
ignored, i.e. allowed. A schema that is not a dict (e.g. `true`) is `ANY`. Nothing here knows
about tokens or text formats.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

ALL_KINDS: frozenset[str] = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
ANY = 0
_MAX_DEPTH = 32


@dataclass(frozen=True)
class SchemaNode:
    kinds: frozenset[str] = ALL_KINDS
    declared: frozenset[str] = frozenset()
    enum: tuple[Any, ...] | None = None
    props: dict[str, int] = field(default_factory=dict)
    closed: bool = False
    required: tuple[str, ...] = ()
    extra: int = ANY
    items: int = ANY
    max_length: int = -1
    max_items: int = -1

    @property
    def keys(self) -> tuple[str, ...]:
        """The keys a closed object may hold, in schema order (properties, then other required)."""
        return (*self.props, *(k for k in self.required if k not in self.props))

    @property
    def text_mode(self) -> bool:
        """True when the qwen3_5 format carries this value as raw text rather than JSON."""
        return not self.declared or "string" in self.declared


def _kind_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _json_ok(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return not (isinstance(value, float) and not math.isfinite(value))


def declared_types(schema: Any) -> set[str]:
    """The JSON types a (sub)schema allows, as far as it says (type, anyOf/oneOf, enum/const kinds);
    empty when it does not say. The output parsers type XML parameter values by the same rule, so
    what the constraint lets through is read back the same way."""
    return _declared(schema) if isinstance(schema, dict) else set()


def _declared(schema: dict[str, Any], depth: int = 0) -> set[str]:
    kinds: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        kinds.add(declared)
    elif isinstance(declared, list):
        kinds.update(t for t in declared if isinstance(t, str))
    for key in ("anyOf", "oneOf"):
        members = schema.get(key)
        if isinstance(members, list) and depth < 8:
            for member in members:
                if isinstance(member, dict):
                    kinds |= _declared(member, depth + 1)
    if not kinds:
        values = _enum_values(schema)
        if values:
            kinds.update(_kind_of(v) for v in values)
    return kinds & ALL_KINDS


def _enum_values(schema: dict[str, Any]) -> tuple[Any, ...] | None:
    if "const" in schema and _json_ok(schema["const"]):
        return (schema["const"],)
    enum = schema.get("enum")
    if isinstance(enum, list):
        values = tuple(v for v in enum if _json_ok(v))
        return values or None
    return None


def _limit(schema: dict[str, Any], key: str) -> int:
    value = schema.get(key)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return -1


class SchemaTable:
    """Compiled schema nodes; ids index `nodes`."""

    def __init__(self) -> None:
        self.nodes: list[SchemaNode] = [SchemaNode()]

    def add(self, schema: Any, *, force_object: bool = False, depth: int = 0) -> int:
        """Compile `schema`; `force_object` restricts the value to a JSON object (tool arguments)."""
        if not isinstance(schema, dict) or depth > _MAX_DEPTH:
            if not force_object:
                return ANY
            schema = {}
        declared = frozenset(_declared(schema))
        kinds = declared or ALL_KINDS
        enum = _enum_values(schema)
        if force_object:
            kinds = frozenset({"object"})
            declared = kinds
            enum = (tuple(v for v in enum if isinstance(v, dict)) or None) if enum else None
        props: dict[str, int] = {}
        raw_props = schema.get("properties")
        if isinstance(raw_props, dict):
            for key, sub in raw_props.items():
                if isinstance(key, str):
                    props[key] = self.add(sub, depth=depth + 1)
        required = schema.get("required")
        req = tuple(dict.fromkeys(k for k in required if isinstance(k, str))) if isinstance(required, list) else ()
        additional = schema.get("additionalProperties")
        closed = additional is False or (bool(props) and additional is None)
        extra = self.add(additional, depth=depth + 1) if isinstance(additional, dict) else ANY
        items = schema.get("items")
        node = SchemaNode(
            kinds=kinds,
            declared=declared,
            enum=enum,
            props=props,
            closed=closed,
            required=req,
            extra=extra,
            items=self.add(items, depth=depth + 1) if isinstance(items, dict) else ANY,
            max_length=_limit(schema, "maxLength"),
            max_items=_limit(schema, "maxItems"),
        )
        if node == self.nodes[ANY]:
            return ANY
        self.nodes.append(node)
        return len(self.nodes) - 1
