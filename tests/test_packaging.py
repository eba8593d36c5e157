"""Packaging promises: no hard dependencies at import time, clear errors for missing extras, and the five core
modules working unedited when copied into a package folder of a NeMo fork."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from optional_imports import CORE_OPTIONAL_MODULES, HIDE_PREAMBLE, LIGHTNING_MODULES, modules_of
from optional_imports import extras as optional_dependencies

REPO = Path(__file__).resolve().parent.parent
CORE_MODULES = ["s3_dirpath_utils", "s3_utils", "s3_checkpoint_io", "s3_dcp", "connector"]


def run_python(code: str, *, hidden: tuple[str, ...] = (), cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    script = HIDE_PREAMBLE.format(hidden=set(hidden)) + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_core_modules_import_with_every_extra_hidden() -> None:
    hidden = CORE_OPTIONAL_MODULES
    result = run_python(
        """
        import s3_dirpath_utils, s3_utils, s3_checkpoint_io, s3_dcp, connector
        assert s3_dirpath_utils.parse_s3_url("s3://bucket/key") == ("bucket", "key")
        print("ok")
        """,
        hidden=hidden,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# Each case: the extra to hide, code that uses a feature needing it, and the package the message must name.
MISSING_EXTRA_CASES = {
    "boto3": (("boto3",), "import s3_utils; s3_utils.S3Utils().client", "boto3", "s3"),
    "botocore": (("botocore", "boto3"), "import s3_utils; s3_utils.get_s3_client()", "boto3", "s3"),
    "awscrt": (
        ("awscrt",),
        "import s3_utils; s3_utils.S3Utils().open_writer('s3://bucket/k.ckpt', checksum_algorithm='CRC32C')",
        "awscrt",
        "s3",
    ),
    "torch": (
        ("torch",),
        "import s3_checkpoint_io; s3_checkpoint_io.S3CheckpointIO('s3://bucket/ckpt')",
        "torch",
        None,
    ),
    "lightning": (
        LIGHTNING_MODULES,
        "import s3_checkpoint_io; s3_checkpoint_io.S3CheckpointIO('s3://bucket/ckpt')",
        "lightning",
        "lightning",
    ),
}


@pytest.mark.parametrize("case", sorted(MISSING_EXTRA_CASES))
def test_missing_extra_raises_actionable_import_error(case: str) -> None:
    hidden, code, package, extra = MISSING_EXTRA_CASES[case]
    result = run_python(
        f"""
        import json, s3_utils
        try:
            {code}
        except ImportError as exc:
            subclass = isinstance(exc, s3_utils.MissingOptionalDependencyError)
            print(json.dumps({{"type": type(exc).__name__, "subclass": subclass, "message": str(exc)}}))
        else:
            print(json.dumps({{"type": None}}))
        """,
        hidden=hidden,
    )
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["type"] == "MissingOptionalDependencyError", outcome
    assert outcome["subclass"]
    assert package in outcome["message"]
    if extra is None:
        assert "pip install torch" in outcome["message"]
    else:
        assert f'pip install "s3-checkpoint-io[{extra}]"' in outcome["message"]


def test_auto_checksum_falls_back_to_crc32_without_awscrt() -> None:
    result = run_python(
        """
        import s3_utils
        print(s3_utils._checksum_algorithm("auto").name)
        """,
        hidden=("awscrt",),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "CRC32"


def public_names(module: str) -> list[str]:
    result = run_python(f"import json, {module}; print(json.dumps(list({module}.__all__)))")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_core_modules_work_copied_into_a_package_folder(tmp_path: Path) -> None:
    package = tmp_path / "nemo_fork" / "utils"
    package.mkdir(parents=True)
    (tmp_path / "nemo_fork" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    for module in CORE_MODULES:
        shutil.copy(REPO / f"{module}.py", package / f"{module}.py")
    imports = "\n        ".join(  # continuation lines keep the indentation of the code block below
        f"from nemo_fork.utils.{module} import {', '.join(public_names(module))}" for module in CORE_MODULES
    )
    # Run from the temporary folder so the repo's own top-level copies cannot be picked up by mistake.
    result = run_python(
        f"""
        import sys
        sys.path = [p for p in sys.path if p not in ("", {str(REPO)!r})]
        sys.path.insert(0, {str(tmp_path)!r})
        {imports}
        import nemo_fork.utils.s3_utils as utils
        assert "s3_utils" not in sys.modules and "s3_dirpath_utils" not in sys.modules, "imported the top-level copies"
        assert utils._urls.__name__ == "nemo_fork.utils.s3_dirpath_utils"
        assert utils.S3Utils.parse_s3_url("s3://bucket/a/b.ckpt") == ("bucket", "a/b.ckpt")
        print("ok")
        """,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_dirpath_utils_needs_only_the_standard_library() -> None:
    result = run_python(
        """
        import sys
        before = set(sys.modules)
        import s3_dirpath_utils
        new = {name.split(".")[0] for name in set(sys.modules) - before}
        print(sorted(new - set(sys.stdlib_module_names) - {"s3_dirpath_utils"}))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_aggregate_extras_contain_what_they_promise() -> None:
    """`all`, `cli` and `demo` list packages instead of naming other extras (pip resolves self-references slowly),
    so check by hand that they stay supersets of the extras they stand for."""
    extras = optional_dependencies()
    assert set(extras["s3"]) | set(extras["lightning"]) <= set(extras["all"])
    assert set(extras["s3"]) <= set(extras["cli"]) <= set(extras["all"])
    assert set(extras["cli"]) | set(extras["lightning"]) <= set(extras["demo"])
    assert not any("s3-checkpoint-io" in requirement for values in extras.values() for requirement in values)
    assert not any(requirement.startswith("torch") for values in extras.values() for requirement in values)


def test_every_package_of_the_user_extras_has_its_modules_hidden_by_the_import_tests() -> None:
    """The import tests hide the modules behind the extras; a package added to an extra must be known there too."""
    names = [name for name in optional_dependencies() if name != "test"]
    assert set(CORE_OPTIONAL_MODULES) <= set(modules_of(*names))
    assert {"boto3", "awscrt", "s3fs", "lightning", "pytorch_lightning", "torch"} <= set(CORE_OPTIONAL_MODULES)


def test_every_module_at_the_repo_root_is_installed() -> None:
    """``pip install`` ships the flat modules listed in ``py-modules``: a new one left out would be missing for users
    (and only there: the tests import the working tree)."""
    import tomllib

    listed = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["py-modules"]
    assert sorted(listed) == sorted(path.stem for path in REPO.glob("*.py"))
