"""The import names behind the package's extras, read from pyproject.toml, and a preamble that hides modules from
the import system: the tests that check "importing needs no extra" and "a missing extra names its pip line" hide
exactly what the extras install (defined once, for test_cli and test_packaging)."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]

# Distribution (as pyproject.toml lists it) -> the top-level modules it installs that the package may import.
_MODULES_OF = {
    "boto3": ("boto3", "botocore", "s3transfer", "awscrt"),
    "s3fs": ("s3fs",),
    "tenacity": ("tenacity",),
    "tqdm": ("tqdm",),
    "lightning": ("lightning", "pytorch_lightning", "lightning_fabric"),
    "moto": ("moto",),
    "matplotlib": ("matplotlib",),
    "psutil": ("psutil",),
    "safetensors": ("safetensors",),
}


def extras() -> dict[str, list[str]]:
    """``[project.optional-dependencies]`` of pyproject.toml."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def modules_of(*extra_names: str) -> tuple[str, ...]:
    """The top-level modules the extras `extra_names` install, plus torch (which no extra lists: users bring the
    build that matches their hardware). KeyError for a distribution `_MODULES_OF` does not know yet."""
    modules: list[str] = []
    for extra in extra_names:
        for requirement in extras()[extra]:
            distribution = re.match(r"[A-Za-z0-9_.-]+", requirement)
            assert distribution, requirement
            for module in _MODULES_OF[distribution.group(0).lower()]:
                if module not in modules:
                    modules.append(module)
    return (*modules, "torch")


LIGHTNING_MODULES = _MODULES_OF["lightning"]
"""The top-level modules the lightning extra installs (both Lightning families and fabric)."""

CORE_OPTIONAL_MODULES = modules_of("s3", "lightning")
"""What the core modules may import: the s3 and lightning extras, and torch."""

DEMO_OPTIONAL_MODULES = modules_of("demo")
"""What the CLI and its demo may import (the demo extra includes the cli and lightning ones), and torch."""

HIDE_PREAMBLE = """
import importlib.abc, sys
HIDDEN = {hidden!r}
class _Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)", name=name)
        return None
sys.meta_path.insert(0, _Hide())
"""
"""Python code (format it with ``hidden=set(...)``) that makes every module named in `hidden`, and its submodules,
fail to import as if it were not installed."""
