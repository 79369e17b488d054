"""Runs in the deploy tool environment (`make tools`: .venv-tools with helm-sdkpy,
kubernetes-validate and a helm binary), not in the project's: the tests call it as a
subprocess and read one JSON document from stdout.

  chart_tool.py lint CHART [VALUES.yaml ...]       Helm's own linter (helm-sdkpy) on the chart with
                                                   those values merged over its values.yaml
  chart_tool.py validate VERSION < objects.json    kubernetes-validate (strict) on each object
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path

import yaml


def merge(base: dict, override: dict) -> dict:
    """Helm's rule for values files: maps merge key by key, everything else is replaced."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def lint(chart: str, values_files: list[str]) -> dict:
    """helm-sdkpy lints a chart directory with its own values.yaml only, so the chart is copied
    (symlinks resolved, as helm package does) and the values files merged into the copy's."""
    import helm_sdkpy

    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / Path(chart).name
        shutil.copytree(chart, copy, symlinks=False)
        values = yaml.safe_load((copy / "values.yaml").read_text()) or {}
        for path in values_files:
            values = merge(values, yaml.safe_load(Path(path).read_text()) or {})
        (copy / "values.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
        result = asyncio.run(helm_sdkpy.Lint(helm_sdkpy.Configuration(namespace="tandem")).run(str(copy)))
    # severities as Helm's lint/support package numbers them: 1 info, 2 warning, 3 error
    messages = [{"severity": m.get("Severity"), "path": m.get("Path"), "error": str(m.get("Err") or "")}
                for m in result.get("Messages") or []]
    return {"charts": result.get("TotalChartsLinted"), "messages": messages, "errors": result.get("Errors")}


def validate(version: str, objects: list[dict]) -> list[dict]:
    import kubernetes_validate

    results = []
    for obj in objects:
        name = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(obj, version, strict=True)
            results.append({"object": name, "ok": True, "error": ""})
        except kubernetes_validate.SchemaNotFoundError as exc:
            results.append({"object": name, "ok": False, "error": f"no schema: {exc}"})
        except kubernetes_validate.ValidationError as exc:
            results.append({"object": name, "ok": False, "error": f"{exc.message} at {list(exc.path)}"})
    return results


def main(argv: list[str]) -> int:
    if argv[:1] == ["lint"] and len(argv) >= 2:
        print(json.dumps(lint(argv[1], argv[2:])))
    elif argv[:1] == ["validate"] and len(argv) == 2:
        print(json.dumps(validate(argv[1], json.load(sys.stdin))))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
