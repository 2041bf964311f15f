"""The container images (deploy/docker/): what the Dockerfiles COPY exists in the repository and is
not dropped by .dockerignore, the ENTRYPOINT is one of the package's console scripts, the bases are
the ones documented, and the tags match the Helm chart's default image. No docker daemon is needed."""
from __future__ import annotations

import glob
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = {"Dockerfile": "cuda", "Dockerfile.cpu": "cpu"}
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined, comments dropped, ${ARG}s expanded."""
    lines, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        lines.append(buf + line)
        buf = ""
    args: dict[str, str] = {}
    out = []
    for line in lines:
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "ARG":
            name, _, default = rest.strip().partition("=")
            args.setdefault(name, default)
        rest = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), rest)
        out.append((op, rest.strip()))
    return out


def copy_sources(path: Path) -> list[str]:
    sources = []
    for op, rest in instructions(path):
        if op not in ("COPY", "ADD"):
            continue
        if rest.startswith("["):
            parts = json.loads(rest)
        else:
            parts = shlex.split(rest)
        if any(p.startswith("--from") for p in parts):
            continue  # from another stage or image, not the build context
        parts = [p for p in parts if not p.startswith("--")]
        sources.extend(parts[:-1])
    return sources


def dockerignore_rules() -> list[tuple[bool, str]]:
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rules.append((negate, line.lstrip("!").strip("/")))
    return rules


def _pattern_matches(pattern: str, path: str) -> bool:
    regex = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            regex += ".*"
            i += 2
            if pattern.startswith("/", i):
                regex += "/?"
                i += 1
            continue
        c = pattern[i]
        regex += "[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c)
        i += 1
    parts = path.split("/")
    # a pattern matching a directory excludes everything in it
    return any(re.fullmatch(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1))


def is_ignored(path: str, rules: list[tuple[bool, str]]) -> bool:
    ignored = False
    for negate, pattern in rules:
        if _pattern_matches(pattern, path):
            ignored = not negate
    return ignored


def files_under(rel: str) -> list[str]:
    base = ROOT / rel
    if base.is_file():
        return [rel]
    return [str(p.relative_to(ROOT)) for p in base.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_copied_paths_exist_and_reach_the_context(name):
    sources = copy_sources(DOCKER / name)
    assert sources, f"{name} copies nothing"
    rules = dockerignore_rules()
    for src in sources:
        matches = glob.glob(str(ROOT / src))
        assert matches, f"{name}: COPY {src}: no such file or directory in the repository"
        for match in matches:
            rel = str(Path(match).relative_to(ROOT))
            files = files_under(rel)
            assert files, f"{name}: COPY {src} is empty"
            dropped = [f for f in files if is_ignored(f, rules)]
            assert not dropped, f"{name}: COPY {src}: .dockerignore drops {dropped[:5]}"


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_the_copied_tree_is_installable(name):
    """`pip install .` needs pyproject.toml, the readme it names, and the package directories."""
    sources = {s.rstrip("/") for s in copy_sources(DOCKER / name)}
    readme = PYPROJECT["project"]["readme"]
    assert {"pyproject.toml", readme if isinstance(readme, str) else readme["file"]} <= sources
    for include in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        top = include.rstrip("*").rstrip(".")
        assert top in sources, f"{name} does not COPY the package {top}/"
    runs = " ".join(rest for op, rest in instructions(DOCKER / name) if op == "RUN")
    assert re.search(r"pip install [^&]*(\"\.\[[\w,]+\]\"|\.(\s|$))", runs), f"{name} does not pip install ."


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_entrypoint_is_a_console_script(name):
    (entrypoint,) = [rest for op, rest in instructions(DOCKER / name) if op == "ENTRYPOINT"]
    command = json.loads(entrypoint)  # exec form, so signals reach epd (SIGTERM stops a tier cleanly)
    assert command[0] in PYPROJECT["project"]["scripts"], f"{command[0]} is not in [project.scripts]"
    assert command == ["epd"]


def test_bases_and_torch_builds():
    gpu_steps = instructions(DOCKER / "Dockerfile")
    cpu_steps = instructions(DOCKER / "Dockerfile.cpu")
    gpu_runs = [rest for op, rest in gpu_steps if op == "RUN"]
    cpu_runs = [rest for op, rest in cpu_steps if op == "RUN"]
    (gpu_from,) = [rest for op, rest in gpu_steps if op == "FROM"]
    (cpu_from,) = [rest for op, rest in cpu_steps if op == "FROM"]
    # devel: FlashInfer (the gpu extra) compiles its kernels at first use with nvcc
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-(cudnn-)?devel-ubuntu[\d.]+", gpu_from)
    assert any('pip install ".[gpu]"' in r for r in gpu_runs), gpu_runs
    assert any(d.startswith("flashinfer-python") for d in PYPROJECT["project"]["optional-dependencies"]["gpu"])
    assert any("python3.11 -m venv" in r for r in gpu_runs)
    # cupy + NCCL for the GPU transports, the extra of the CUDA major the installed torch was built for
    assert any('pip install ".[cuda$(python -c "import torch; print(torch.version.cuda.split(\'.\')[0])")]"' in r
               for r in gpu_runs), gpu_runs
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert any(d.startswith("cupy-cuda12x") for d in extras["cuda12"])
    assert any(d.startswith("cupy-cuda13x") for d in extras["cuda13"])
    assert cpu_from == "python:3.11-slim"
    # the chart's default is a preset; the encoder cache store's client and binaries come with every image
    assert any('pip install -c constraints/cpu.txt ".[presets,mooncake]"' in r for r in cpu_runs)
    assert any('pip install ".[presets,mooncake]"' in r for r in gpu_runs)
    assert all(any("libibverbs1 librdmacm1" in r for r in runs) for runs in (cpu_runs, gpu_runs))
    pins = [line for line in (ROOT / "constraints" / "cpu.txt").read_text().splitlines() if line.startswith("torch==")]
    assert len(pins) == 1, "constraints/cpu.txt must pin torch exactly once"
    assert any("grep -E '^torch==' constraints/cpu.txt" in r for r in cpu_runs)


def test_chart_default_image_is_built_here():
    """The chart's default tags (<appVersion>-cpu / -cuda) are the ones the Dockerfiles document."""
    chart = yaml.safe_load((ROOT / "deploy" / "helm" / "epd" / "Chart.yaml").read_text())
    values = yaml.safe_load((ROOT / "deploy" / "helm" / "epd" / "values.yaml").read_text())
    repo, version = values["image"]["repository"], chart["appVersion"]
    assert version == PYPROJECT["project"]["version"]
    for name, flavor in DOCKERFILES.items():
        header = (DOCKER / name).read_text()
        assert f"-f deploy/docker/{name} -t REGISTRY/{repo}:{version}-{flavor} ." in header
    assert values["image"]["tag"] == ""  # so the chart derives <appVersion>-<flavor>
