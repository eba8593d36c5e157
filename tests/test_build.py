"""The distribution builds cleanly: no warning from the build backend, the metadata says what pyproject.toml says,
and the version the modules report is the distribution's."""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CORE_MODULES = [
    "s3_dirpath_utils",
    "s3_process",
    "s3_pacing",
    "s3_utils",
    "s3_fencing",
    "s3_checkpoint_io",
    "connector",
    "s3_checkpoint_admin",
    "s3_checkpoint_cli",
    "s3_checkpoint_convert",
]


def _pyproject_version() -> str:
    match = re.search(r'^version = "([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert match, "pyproject.toml has no static version"
    return match.group(1)


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Build the wheel from a copy of the sources (the checkout stays clean) with pip's isolated build, verbose so
    the backend's own output (where setuptools prints its deprecation warnings) is kept."""
    source = tmp_path_factory.mktemp("source")
    for path in [REPO / "pyproject.toml", REPO / "README.md", *REPO.glob("*.py")]:
        shutil.copy2(path, source / path.name)
    out = tmp_path_factory.mktemp("dist")
    # Without PYTHONDONTWRITEBYTECODE: with it, setuptools says that it skips byte-compiling (an environment note).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "-v", "-w", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], result.stdout + result.stderr


def test_building_the_wheel_prints_no_warning(built_wheel: tuple[Path, str]) -> None:
    _, output = built_wheel
    # pip's own notes about the index locations of this machine are not the build's.
    lines = [line for line in output.splitlines() if "Location '" not in line]
    warnings = [line for line in lines if re.search(r"warn|deprecat", line, re.IGNORECASE)]
    assert warnings == [], "\n".join(warnings)


def test_wheel_metadata_and_modules(built_wheel: tuple[Path, str]) -> None:
    wheel, _ = built_wheel
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata_name = next(name for name in names if name.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(archive.read(metadata_name))
    assert {f"{module}.py" for module in CORE_MODULES} <= names
    assert metadata["Name"] == "s3-checkpoint-io"
    assert metadata["Version"] == _pyproject_version()
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["Requires-Python"] == ">=3.10"
    assert "bench" in metadata.get_all("Provides-Extra")


def test_fallback_version_matches_pyproject() -> None:
    """Fork copies, which have no distribution metadata, report the constant: it must not drift from pyproject."""
    import s3_dirpath_utils

    assert s3_dirpath_utils._FALLBACK_VERSION == _pyproject_version()


def test_every_module_reports_one_version() -> None:
    import s3_checkpoint_io
    import s3_dirpath_utils
    import s3_utils

    assert s3_dirpath_utils.__version__ == s3_utils.__version__ == s3_checkpoint_io.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", s3_dirpath_utils.__version__)
