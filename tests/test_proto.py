"""The committed Python code of proto/*.proto is what `make proto` generates now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current(tmp_path):
    protos = sorted(p.relative_to(ROOT) for p in (ROOT / "proto").glob("*.proto"))
    assert protos, "no .proto files found"
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT), f"--python_out={tmp_path}",
         f"--grpc_python_out={tmp_path}", *map(str, protos)],
        check=True, cwd=ROOT, timeout=120,
    )
    generated = sorted(tmp_path.glob("proto/*.py"))
    assert generated
    for fresh in generated:
        committed = ROOT / "proto" / fresh.name
        assert committed.exists(), f"{committed} is missing: run `make proto`"
        assert committed.read_text() == fresh.read_text(), f"{committed} is stale: run `make proto`"
