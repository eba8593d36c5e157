"""Packaging promises: no hard dependencies at import time, clear errors for missing extras, and the five core
modules working unedited when copied into a package folder of a NeMo fork."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

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
        print(s3_utils.ChecksumAlgorithm.named("auto").name)
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
        import nemo_fork.utils.connector as connector
        assert "s3_utils" not in sys.modules and "s3_dirpath_utils" not in sys.modules, "imported the top-level copies"
        assert utils._urls.__name__ == "nemo_fork.utils.s3_dirpath_utils"
        assert connector._dcp.__name__ == "nemo_fork.utils.s3_dcp"  # DCP features light up with the fifth file
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


FOUR_CORE_FILES = ["s3_dirpath_utils", "s3_utils", "s3_checkpoint_io", "connector"]
"""What the design card names: a fork may copy only these (no s3_dcp: no sharded checkpoints on S3)."""

FOUR_FILE_FORKS = """
import importlib, sys, types
sys.path = [p for p in sys.path if p not in ("", {repo!r})]
sys.path[:0] = [{package_root!r}, {flat!r}]
# An editable install of this repository maps its module names to the repo's files: keep only the copies.
sys.meta_path = [finder for finder in sys.meta_path if not finder.__module__.startswith("__editable__")]
import torch

def fork(package, folder, url):
    connector = importlib.import_module(package + "connector")
    s3_checkpoint_io = importlib.import_module(package + "s3_checkpoint_io")
    assert s3_checkpoint_io.__file__.startswith(folder) and connector.__file__.startswith(folder)
    plugin = s3_checkpoint_io.S3CheckpointIO(url, chunk_size_MB=5)
    state = {{"w": torch.arange(10.0), "global_step": 3}}
    plugin.save_checkpoint(state, url + "/m-step=3-last.ckpt")
    found = connector.find_resume_checkpoint(url)
    assert found == url + "/m-step=3-last.ckpt", found
    trainer = types.SimpleNamespace(ckpt_path=None)
    assert connector.check_resume(trainer, resume_if_exists=True, dirpath=url) == found == trainer.ckpt_path
    loaded = plugin.load_checkpoint(found)
    assert torch.equal(loaded["w"], state["w"]) and loaded["global_step"] == 3
    plugin.teardown()
    assert connector._dcp is None and not [name for name in sys.modules if name.endswith("s3_dcp")]

    # A newer sharded (DCP) checkpoint: neither a silent fall back to the older file nor an obscure failure.
    bucket, key = url[5:].split("/", 1)
    for name in ("__0_0.distcp", ".metadata"):
        plugin.s3.client.put_object(Bucket=bucket, Key=key + "/m-step=9-last.ckpt/" + name, Body=b"x")
    cfg = {{"exp_manager": {{"checkpoint_callback_params": {{"dirpath": url, "filename": "m-{{step}}"}}}}}}
    callback = connector.build_s3_checkpointing(cfg).checkpoint_callback  # the config wiring's S3ModelCheckpoint
    for attempt in (
        lambda: connector.find_resume_checkpoint(url),
        lambda: connector.check_resume(trainer, resume_if_exists=True, dirpath=url),
        callback.last_checkpoint_times,  # what ckpt_path="last" asks
    ):
        try:
            attempt()
        except connector.DCPSupportMissingError as exc:
            print(exc)

fork("nemo_fork.utils.", {package_folder!r}, {url!r} + "/package")
fork("", {flat!r}, {url!r} + "/top-level")
"""


def test_forks_of_the_four_core_files_checkpoint_resume_and_name_what_a_dcp_checkpoint_needs(
    bucket: str, s3_server: Any, tmp_path: Path
) -> None:
    """The four files copied into a package folder and as top-level modules (both in one interpreter: their
    module names differ): single-file save, resume discovery and load work, and a DCP checkpoint met on resume
    names itself and the missing s3_dcp.py."""
    if s3_server.name == "seaweedfs":
        pytest.skip("what is tested is the forks' imports; one local server serves it")
    package_folder, flat = tmp_path / "nemo_fork" / "utils", tmp_path / "flat"
    for folder in (package_folder, flat):
        folder.mkdir(parents=True)
        for module in FOUR_CORE_FILES:
            shutil.copy(REPO / f"{module}.py", folder / f"{module}.py")
    for init in (tmp_path / "nemo_fork", package_folder):
        (init / "__init__.py").write_text("")
    url = f"s3://{bucket}/run"
    code = FOUR_FILE_FORKS.format(
        repo=str(REPO), package_root=str(tmp_path), flat=str(flat), package_folder=str(package_folder), url=url
    )
    result = run_python(code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    errors = result.stdout.strip().splitlines()
    assert len(errors) == 6, result.stdout
    expected = [("package", package_folder)] * 3 + [("top-level", flat)] * 3
    for message, (layout, folder) in zip(errors, expected, strict=True):
        assert f"{url}/{layout}/m-step=9-last.ckpt is a sharded (torch.distributed.checkpoint) checkpoint" in message
        assert f"needs s3_dcp.py, which is not beside connector.py in {folder}" in message


def test_connector_spells_the_dcp_file_names_as_s3_dcp_does() -> None:
    import connector
    import s3_dcp

    assert connector._dcp is s3_dcp
    names = ("METADATA_NAME", "DCP_SHARD_SUFFIX", "ITEM_CHECKSUMS_NAME", "LIGHTNING_META_NAME")
    assert [getattr(connector, f"_{name}") for name in names] == [getattr(s3_dcp, name) for name in names]
