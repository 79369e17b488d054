"""The container images, checked the way a machine without a Docker engine can: each
Dockerfile parses into known instructions, pins its bases, ends as a non-root user, copies
every package the project installs, and every `tandem` command it runs parses with the real
command-line parser (so an image cannot drift from the CLI)."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from cluster.cli import build_parser

ROOT = Path(__file__).parents[2]
DOCKERFILES = sorted((ROOT / "deploy/docker").glob("Dockerfile.*"))
_INSTRUCTIONS = {"FROM", "RUN", "COPY", "ENV", "ARG", "WORKDIR", "USER", "EXPOSE", "ENTRYPOINT", "CMD", "LABEL"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", path.read_text())
    parsed = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        parsed.append((keyword, rest.strip()))
    return parsed


def _args(path: Path) -> dict[str, str]:
    return {name: value for keyword, rest in instructions(path) if keyword == "ARG" and "=" in rest
            for name, value in [rest.split("=", 1)]}


def test_there_is_a_cpu_and_a_cuda_image():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.cuda"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_structure(path: Path):
    parsed = instructions(path)
    assert {keyword for keyword, _ in parsed} <= _INSTRUCTIONS, "an unknown instruction"
    args = _args(path)
    bases = [rest.split()[0] for keyword, rest in parsed if keyword == "FROM"]
    assert len(bases) == 2, "multi-stage: a build stage and a runtime stage"
    for base in bases:
        image = args.get(base.strip("${}"), base)
        name, _, tag = image.partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), f"{image} is not pinned to a version"
    runtime = parsed[max(i for i, (k, _) in enumerate(parsed) if k == "FROM"):]
    users = [rest for keyword, rest in runtime if keyword == "USER"]
    assert users and users[-1] not in ("0", "root"), "the runtime stage must not run as root"
    assert any(keyword == "COPY" and "--from=build" in rest for keyword, rest in runtime)
    exposed = {port for keyword, rest in runtime if keyword == "EXPOSE" for port in rest.split()}
    assert exposed == {"8000", "50051"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_installed_package_is_copied(path: Path):
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    sources = {name for keyword, rest in instructions(path) if keyword == "COPY" and "--from" not in rest
               for name in rest.split()[:-1]}  # every word but the destination
    assert {p.rstrip("*") for p in packages} | {"pyproject.toml", "constraints.txt"} <= sources
    torch_pins = [rest for keyword, rest in instructions(path) if keyword == "RUN" and "torch==" in rest]
    assert torch_pins and all("torch==2.13.0" in pin for pin in torch_pins)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_tandem_commands_parse_with_the_real_cli(path: Path):
    parsed = instructions(path)
    entrypoint = json.loads(next(rest for keyword, rest in parsed if keyword == "ENTRYPOINT"))
    cmd = json.loads(next(rest for keyword, rest in parsed if keyword == "CMD"))
    assert entrypoint[:2] == ["tandem", "serve"]
    args = build_parser().parse_args(entrypoint[1:] + cmd)
    assert (args.host, args.port, args.grpc_port) == ("0.0.0.0", 8000, 50051)
    model = _args(path)["MODEL"]
    commands = [segment.strip() for keyword, rest in parsed if keyword == "RUN"
                for segment in re.split(r";|&&|\bthen\b|\bfi\b", rest.replace('"$MODEL"', model))
                if segment.strip().startswith("tandem ")]
    assert commands == [f"tandem models fetch {model}"]  # the model is fetched at build time
    for command in commands:
        build_parser().parse_args(shlex.split(command)[1:])


def test_dockerignore_keeps_the_context_clean():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "tests"} <= ignored
