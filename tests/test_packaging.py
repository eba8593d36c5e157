"""Packaging promises: no hard dependencies at import time, clear errors for missing extras, and the core modules
(with or without the optional siblings s3_dcp, s3_node_sharing and s3_memory_tier) working unedited when copied into
a NeMo fork."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
from optional_imports import CORE_OPTIONAL_MODULES, HIDE_PREAMBLE, LIGHTNING_MODULES, modules_of
from optional_imports import extras as optional_dependencies

REPO = Path(__file__).resolve().parent.parent
CORE_MODULES = [
    "s3_dirpath_utils", "s3_process", "s3_pacing", "s3_utils", "s3_fencing", "s3_checkpoint_io", "s3_prefix_spreading",
    "s3_dcp", "s3_node_sharing", "s3_memory_tier", "connector",
]


def run_python(code: str, *, hidden: tuple[str, ...] = (), cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    script = HIDE_PREAMBLE.format(hidden=set(hidden)) + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_core_modules_import_with_every_extra_hidden() -> None:
    hidden = CORE_OPTIONAL_MODULES
    result = run_python(
        """
        import s3_dirpath_utils, s3_process, s3_pacing, s3_utils, s3_fencing, s3_checkpoint_io
        import s3_dcp, s3_node_sharing, s3_memory_tier
        import connector
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
        f"from nemo_fork.utils.{module} import {', '.join(names)}"
        if (names := public_names(module))
        else f"import nemo_fork.utils.{module}"  # a sibling with no public names (docs/api.md)
        for module in CORE_MODULES
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
        assert connector._s3_dcp().__name__ == "nemo_fork.utils.s3_dcp"  # DCP features light up with its file
        import nemo_fork.utils.s3_process as process
        assert process.node_sharing().__name__ == "nemo_fork.utils.s3_node_sharing"  # and host sharing with its file
        import nemo_fork.utils.s3_checkpoint_io as ckpt_io
        assert ckpt_io._memory_tier_module().__name__ == "nemo_fork.utils.s3_memory_tier"  # the memory tier
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


CORE_FILES = ["s3_dirpath_utils", "s3_process", "s3_pacing", "s3_utils", "s3_fencing", "s3_checkpoint_io", "connector"]
"""What the design card names: a fork may copy only these (no s3_dcp: no sharded checkpoints on S3)."""

CORE_FILE_FORKS = """
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
    assert connector._s3_dcp() is None and not [name for name in sys.modules if name.endswith("s3_dcp")]

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


def test_forks_of_the_core_files_checkpoint_resume_and_name_what_a_dcp_checkpoint_needs(
    bucket: str, s3_server: Any, tmp_path: Path
) -> None:
    """The seven files copied into a package folder and as top-level modules (both in one interpreter: their
    module names differ): single-file save, resume discovery and load work, and a DCP checkpoint met on resume
    names itself and the missing s3_dcp.py."""
    if s3_server.name == "seaweedfs":
        pytest.skip("what is tested is the forks' imports; one local server serves it")
    package_folder, flat = tmp_path / "nemo_fork" / "utils", tmp_path / "flat"
    for folder in (package_folder, flat):
        folder.mkdir(parents=True)
        for module in CORE_FILES:
            shutil.copy(REPO / f"{module}.py", folder / f"{module}.py")
    for init in (tmp_path / "nemo_fork", package_folder):
        (init / "__init__.py").write_text("")
    url = f"s3://{bucket}/run"
    code = CORE_FILE_FORKS.format(
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

    assert connector._s3_dcp() is s3_dcp
    names = ("METADATA_NAME", "DCP_SHARD_SUFFIX", "ITEM_CHECKSUMS_NAME", "LIGHTNING_META_NAME")
    assert [getattr(connector, f"_{name}") for name in names] == [getattr(s3_dcp, name) for name in names]
    import s3_prefix_spreading

    assert connector._LAYOUT_NAME == s3_prefix_spreading.LAYOUT_NAME
    import s3_dcp_tier  # its own spellings too: it cannot import s3_dcp, which imports it

    assert (s3_dcp_tier.ITEMS_SUFFIX, s3_dcp_tier.SHARD_SUFFIX) == (s3_dcp.ITEM_CHECKSUMS_NAME, s3_dcp.DCP_SHARD_SUFFIX)


FORK_RANK = """
import importlib, json, logging, sys
sys.path = [p for p in sys.path if p not in ("", {repo!r})]
sys.path[:0] = [{package_root!r}, {flat!r}]
sys.meta_path = [finder for finder in sys.meta_path if not finder.__module__.startswith("__editable__")]
logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
report = {{}}
for layout, package, folder in (("package", "nemo_fork.utils.", {package_folder!r}), ("top-level", "", {flat!r})):
    s3_checkpoint_io = importlib.import_module(package + "s3_checkpoint_io")
    assert s3_checkpoint_io.__file__.startswith(folder), s3_checkpoint_io.__file__
    url = {url!r} + "/" + layout
    plugin = s3_checkpoint_io.S3CheckpointIO(url, chunk_size_MB=5)  # load_sharing="node", the default
    state = {{"w": torch.arange(10.0) + rank, "global_step": 3}}
    plugin.save_checkpoint(state, f"{{url}}/rank{{rank}}/m-step=3.ckpt")
    dist.barrier()
    with plugin.collective_load():  # what the connector's resume does: every rank loads rank 0's checkpoint
        loaded = plugin.load_checkpoint(f"{{url}}/rank0/m-step=3.ckpt")
    assert torch.equal(loaded["w"], torch.arange(10.0)) and loaded["global_step"] == 3
    plugin.teardown()
    s3_utils = importlib.import_module(package + "s3_utils")
    s3_process = importlib.import_module(package + "s3_process")
    report[layout] = {{
        "sharing_module": getattr(s3_process.node_sharing(), "__file__", None),
        "pacer_shared": s3_utils.request_pacer(None, "fork-bucket").shared,
        "load_verified_here": plugin.records[-1].checksum is not None,  # a shared load maps the node's copy (None)
    }}
print(json.dumps(report), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("with_node_sharing", [False, True], ids=["core-files", "with-s3_node_sharing"])
def test_a_two_rank_job_of_the_core_files_works_and_warns_once_that_host_sharing_is_missing(
    bucket: str, s3_server: Any, tmp_path: Path, with_node_sharing: bool
) -> None:
    """Two real ranks (gloo, torchrun's environment) of a fork that copied the seven core files, as a package and as
    top-level modules: each saves, then all load rank 0's checkpoint collectively. Without s3_node_sharing.py each
    rank paces on its own and downloads for itself, and says once (per copy of s3_utils) what is missing and what to
    copy; with it beside them, the pacer is the host's, the load is shared, and nothing is said."""
    from s3_servers import rank_environment, skip_unless_multirank_backend

    skip_unless_multirank_backend(s3_server)
    package_folder, flat = tmp_path / "nemo_fork" / "utils", tmp_path / "flat"
    modules = CORE_FILES + (["s3_node_sharing"] if with_node_sharing else [])
    for folder in (package_folder, flat):
        folder.mkdir(parents=True)
        for module in modules:
            shutil.copy(REPO / f"{module}.py", folder / f"{module}.py")
    for init in (tmp_path / "nemo_fork", package_folder):
        (init / "__init__.py").write_text("")
    code = FORK_RANK.format(
        repo=str(REPO),
        package_root=str(tmp_path),
        flat=str(flat),
        package_folder=str(package_folder),
        url=f"s3://{bucket}/fork",
    )
    base = rank_environment(s3_server, os.environ["AWS_ENDPOINT_URL_S3"], WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    base.update(PYTHONPATH="", TORCHELASTIC_RUN_ID=f"fork-{uuid.uuid4().hex}")
    base.pop("S3CKPT_PACER_SHARING", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0"},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=240) for proc in procs]
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank}: {err}"
        report = json.loads(out.strip().splitlines()[-1])
        warnings = [line for line in err.splitlines() if "s3_node_sharing.py is not beside s3_utils.py" in line]
        for layout, folder in (("package", package_folder), ("top-level", flat)):
            seen = report[layout]
            if with_node_sharing:
                assert seen["sharing_module"] == str(folder / "s3_node_sharing.py"), seen
                assert seen["pacer_shared"] and not seen["load_verified_here"], (rank, seen)
            else:
                assert seen == {"sharing_module": None, "pacer_shared": False, "load_verified_here": True}, seen
        if with_node_sharing:
            assert warnings == [], err
            continue
        assert len(warnings) == 2, err  # once per process and copy of s3_utils: the package's and the top-level one
        for warning, folder in zip(warnings, (package_folder, flat), strict=True):
            assert "WARNING" in warning and "This job has 2 processes" in warning and f"in {folder}:" in warning
            assert "each process paces its S3 requests on its own" in warning
            assert "every rank downloads the checkpoints it loads" in warning
            assert "Copy s3_node_sharing.py" in warning
