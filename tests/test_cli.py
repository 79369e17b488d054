"""The `tandem` command line, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "cluster.cli", *args], capture_output=True, text=True, timeout=300)


def test_models_list_and_unknown_fetch():
    listed = run("models", "list")
    assert listed.returncode == 0 and "smollm2-135m-instruct" in listed.stdout
    bad = run("models", "fetch", "no-such-model")
    assert bad.returncode == 2 and "unknown model 'no-such-model'" in bad.stderr


def test_fetch_known_model_prints_cached_directory(smollm_dir):
    fetched = run("models", "fetch", "smollm2-135m-instruct")
    assert fetched.returncode == 0 and fetched.stdout.strip() == str(smollm_dir)


def test_generate_offline(smollm_dir):
    result = run("generate", "--model", str(smollm_dir), "--dtype", "float32", "--max-tokens", "8",
                 "--max-model-len", "512", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
