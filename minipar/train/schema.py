"""The report's JSON Schema (`report.schema.json`, beside this file) and a validator for
the subset of JSON Schema it uses, so the library needs no extra dependency (the tests
also validate with the `jsonschema` package when it is installed)."""

from __future__ import annotations

import json
from pathlib import Path

from minipar.parallel.pipeline.schedules.registry import schedule_names

SCHEMA_PATH = Path(__file__).with_name("report.schema.json")


def load_schema() -> dict:
    """The report's JSON Schema. The file lists the built-in schedules for readers outside
    Python; the names allowed are the schedule registry's (a test keeps the two equal)."""
    schema = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
    schema["properties"]["config"]["properties"]["schedule"]["enum"] = list(schedule_names())
    return schema


def validate_report(data: dict) -> None:
    """Raise ValueError naming the first field that breaks `report.schema.json`.

    A small validator for the subset of JSON Schema the file uses (type, required,
    properties, items, enum, const, minimum), so the library needs no extra dependency."""
    _validate(data, load_schema(), "report")


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
          "integer": int, "number": (int, float)}


def _validate(value, schema: dict, where: str) -> None:
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        ok = any(isinstance(value, _TYPES[t]) and not (t in ("integer", "number")
                 and isinstance(value, bool)) for t in types)
        if not ok:
            raise ValueError(f"{where}: expected {' or '.join(types)}, got {type(value).__name__}")
    if "const" in schema and value != schema["const"]:
        raise ValueError(f"{where}: expected {schema['const']!r}, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise ValueError(f"{where}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and isinstance(value, (int, float)) and value < schema["minimum"]:
        raise ValueError(f"{where}: {value} is below the minimum {schema['minimum']}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                raise ValueError(f"{where}: missing required field {key!r}")
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                _validate(value[key], sub, f"{where}.{key}")
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in set(value) - set(schema.get("properties", {})):
                _validate(value[key], extra, f"{where}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _validate(item, schema["items"], f"{where}[{i}]")
