"""The chart's values.schema.json checks ``inferenceExtension.poolConfig`` against the picker's own
configuration model and ``keda.{prefill,decode}.signal`` against the scaler's signals: its
``definitions`` marked ``x-generated-from`` are generated from ``router.server.config.PoolConfig``
and ``router.adapters.keda.scaler.SIGNALS`` (the rest of the file is written by hand). After a
change to either, regenerate them with

    python3 tests/helm/poolconfig_schema.py

``tests/helm/test_schema.py`` fails while the file is stale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "helm" / "pd-router" / "values.schema.json"
MARK = "x-generated-from"


# `helm --set a=0.5` leaves 0.5 a string (Helm converts integers only) and the picker's loader
# takes a numeric string as the number: so does the schema (numeric keywords skip strings).
NUMERIC_STRING = r"^[-+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+)?$"


def _tidy(node: Any) -> Any:
    """No titles (they repeat the field names) and no defaults (Helm does not apply them, and they
    would make the file stale at every change of one); a number may be a numeric string."""
    if isinstance(node, list):
        return [_tidy(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {
        # under "properties" the keys are field names (LinksConfig has one called "default")
        k: {name: _tidy(field) for name, field in v.items()} if k == "properties" else _tidy(v)
        for k, v in node.items()
        if k != "default" and (k != "title" or not isinstance(v, str))
    }
    if out.get("type") == "number":
        out["type"] = ["number", "string"]
        out["pattern"] = NUMERIC_STRING
    return out


def generated_definitions() -> dict[str, Any]:
    """PoolConfig and every model it uses, and the KEDA signals, as draft-07 ``definitions`` (Helm 3
    and 4 read them)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from router.adapters.keda.scaler import SIGNALS
    from router.server.config import PoolConfig

    schema = PoolConfig.model_json_schema(ref_template="#/definitions/{model}")
    definitions = schema.pop("$defs", {})
    # `model` stays required, by the chart's own check: its message says which value to set.
    schema["required"] = [name for name in schema.get("required", []) if name != "model"]
    if not schema["required"]:
        del schema["required"]
    schema["properties"]["model"].pop("minLength", None)
    definitions["PoolConfig"] = schema
    out = {}
    for name in sorted(definitions):
        body = _tidy(definitions[name])
        out[name] = {MARK: f"router.server.config.{name}", **body}
    out["KedaSignal"] = {MARK: "router.adapters.keda.scaler.SIGNALS", "enum": list(SIGNALS)}
    return out


def updated(text: str) -> str:
    """values.schema.json's text with the generated definitions replaced by fresh ones."""
    schema = json.loads(text)
    kept = {k: v for k, v in schema.get("definitions", {}).items() if MARK not in v}
    schema["definitions"] = {**kept, **generated_definitions()}
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    text = SCHEMA.read_text(encoding="utf-8")
    new = updated(text)
    if new == text:
        print(f"{SCHEMA.relative_to(ROOT)}: up to date")
    else:
        SCHEMA.write_text(new, encoding="utf-8")
        print(f"{SCHEMA.relative_to(ROOT)}: generated definitions rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
