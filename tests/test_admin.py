"""`s3_checkpoint_admin`, the operator API in Python, against a real local S3 server: the ``rm --keep-last`` rule,
incomplete DCP checkpoints found by their age on the store's clock and removed only when unchanged, and a clear
error where ``s3_dcp.py`` is missing (which neither the CLI nor connector imports before a DCP checkpoint needs it)."""

from __future__ import annotations

import datetime
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from optional_imports import HIDE_PREAMBLE

import s3_checkpoint_admin as admin
from s3_utils import CHECKSUM_SIDECAR_SUFFIX, S3Utils

REPO = Path(__file__).resolve().parent.parent


def keys(s3_client: Any, bucket: str) -> set[str]:
    return {o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket).get("Contents", [])}


def test_pruning_keeps_the_newest_top_k_and_never_last_end_step_less_or_uncommitted(
    bucket: str, s3_client: Any, s3_server: Any
) -> None:
    names = ["m-step=10.ckpt", "m-step=30.ckpt", "m-step=20.ckpt", "m-step=40-last.ckpt", "m-step=50-end.ckpt"]
    names += ["best.ckpt", "notes.txt"]
    for name in names:
        s3_client.put_object(Bucket=bucket, Key=f"run/{name}", Body=b"x")
    for name in ("__0_0.distcp", ".metadata"):  # a complete DCP checkpoint counts as one top-k checkpoint
        s3_client.put_object(Bucket=bucket, Key=f"run/m-step=25.ckpt/{name}", Body=b"y")
    s3_client.put_object(Bucket=bucket, Key="run/m-step=60.ckpt/__0_0.distcp", Body=b"z")  # its save still runs
    url = f"s3://{bucket}/run"
    s3 = S3Utils()

    entries = admin.list_checkpoints(url, s3_utils=s3)
    assert [(e.name, e.step, e.kind, e.shards, e.complete) for e in entries] == [
        ("m-step=10.ckpt", 10, "top-k", None, True),
        ("m-step=20.ckpt", 20, "top-k", None, True),
        ("m-step=25.ckpt", 25, "top-k", 1, True),
        ("m-step=30.ckpt", 30, "top-k", None, True),
        ("m-step=40-last.ckpt", 40, "last", None, True),
        ("m-step=50-end.ckpt", 50, "end", None, True),
        ("m-step=60.ckpt", 60, "top-k", 1, False),
        ("best.ckpt", None, "top-k", None, True),
    ]
    plan = admin.plan_pruning(entries, 2)
    assert [e.name for e in plan.delete] == ["m-step=10.ckpt", "m-step=20.ckpt"]  # oldest first
    assert [e.name for e in plan.keep] == ["m-step=30.ckpt", "m-step=25.ckpt"]  # newest first
    assert [(e.name, why) for e, why in plan.protected] == [
        ("m-step=40-last.ckpt", "a last checkpoint"),
        ("m-step=50-end.ckpt", "an end checkpoint"),
        ("m-step=60.ckpt", "no .metadata: its save may still be running"),
        ("best.ckpt", "no step= in its name"),
    ]
    with pytest.raises(ValueError, match="keep_last must be >= 0"):
        admin.plan_pruning(entries, -1)

    before = keys(s3_client, bucket)
    assert admin.prune_checkpoints(url, 2, dry_run=True, s3_utils=s3) == plan
    assert keys(s3_client, bucket) == before
    assert admin.prune_checkpoints(url, 0, s3_utils=s3).delete == (*plan.delete, *reversed(plan.keep))
    assert keys(s3_client, bucket) == before - {
        "run/m-step=10.ckpt",
        "run/m-step=20.ckpt",
        "run/m-step=30.ckpt",
        "run/m-step=25.ckpt/__0_0.distcp",
        "run/m-step=25.ckpt/.metadata",
    }
    with pytest.raises(FileNotFoundError, match="no checkpoints"):
        admin.prune_checkpoints(f"s3://{bucket}/nothing-here", 1, s3_utils=s3)


def test_incomplete_dcp_checkpoints_are_found_by_age_and_removed_only_while_unchanged(
    bucket: str, s3_client: Any, s3_server: Any
) -> None:
    """Object times are real on moto too (only its upload initiation times are not: tests/test_gc.py)."""
    put = lambda key: s3_client.put_object(Bucket=bucket, Key=key, Body=b"x" * 100)  # noqa: E731
    for name in ("__0_0.distcp", "__1_0.distcp", "__1_0.distcp" + CHECKSUM_SIDECAR_SUFFIX, ".s3ckpt-owner.json"):
        put(f"run/dead-step=5.ckpt/{name}")
    for name in ("__0_0.distcp", ".metadata"):
        put(f"run/good-step=4.ckpt/{name}")
    put("run/deeper/x-step=7.ckpt/__0_0.distcp")
    put("run_old/other-step=1.ckpt/__0_0.distcp")  # beside the prefix, not under it
    time.sleep(2.6)  # ages are whole seconds on SeaweedFS
    put("run/new-step=9.ckpt/__0_0.distcp")  # a save under way

    url = f"s3://{bucket}/run"
    garbage = admin.find_garbage(url, datetime.timedelta(seconds=1), incomplete_checkpoints=True)
    assert [c.url for c in garbage.checkpoints] == [f"{url}/dead-step=5.ckpt", f"{url}/deeper/x-step=7.ckpt"]
    dead = garbage.checkpoints[0]
    assert sorted(info.key for info in dead.files) == [
        "run/dead-step=5.ckpt/__0_0.distcp",
        "run/dead-step=5.ckpt/__1_0.distcp",
        "run/dead-step=5.ckpt/__1_0.distcp" + CHECKSUM_SIDECAR_SUFFIX,
    ]
    assert dead.kept == (f"{url}/dead-step=5.ckpt/.s3ckpt-owner.json",) and dead.size == 300
    assert garbage.younger == 1 and garbage.age(dead) >= datetime.timedelta(seconds=1)
    assert admin.find_garbage(url, datetime.timedelta(seconds=1)).checkpoints == []  # only when asked for
    with pytest.raises(ValueError, match="must be positive"):
        admin.find_garbage(url, datetime.timedelta(0))

    put("run/deeper/x-step=7.ckpt/__1_0.distcp")  # a save starts there again after the search
    s3 = S3Utils()
    assert [admin.remove_incomplete_checkpoint(c, s3_utils=s3) for c in garbage.checkpoints] == [True, False]
    assert {key for key in keys(s3_client, bucket) if "dead-step" in key or "x-step" in key} == {
        "run/dead-step=5.ckpt/.s3ckpt-owner.json",
        "run/deeper/x-step=7.ckpt/__0_0.distcp",
        "run/deeper/x-step=7.ckpt/__1_0.distcp",
    }
    assert {"run/good-step=4.ckpt/.metadata", "run_old/other-step=1.ckpt/__0_0.distcp"} <= keys(s3_client, bucket)


def test_cli_and_connector_import_s3_dcp_only_when_needed_and_admin_names_it_when_missing() -> None:
    """Importing the CLI, connector or admin imports no s3_dcp; a DCP checkpoint met without s3_dcp.py raises
    `connector.DCPSupportMissingError` naming the file, before any request, and the CLI maps it to exit 5."""
    lazy = subprocess.run(
        [sys.executable, "-c", "import sys, s3_checkpoint_cli, connector, s3_checkpoint_admin\n"
         "assert 's3_dcp' not in sys.modules and 's3_checkpoint_convert' not in sys.modules, sorted(sys.modules)"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert lazy.returncode == 0, lazy.stderr
    script = HIDE_PREAMBLE.format(hidden={"s3_dcp"}) + textwrap.dedent(
        """
        import connector, s3_checkpoint_admin as admin, s3_checkpoint_cli as cli
        for attempt in (
            lambda: admin.verify_checkpoint("s3://bucket/run/x-step=3.ckpt"),
            lambda: admin.CheckpointEntry.from_dcp("s3://bucket/run/x.ckpt", "x.ckpt", [], {"__0_0.distcp"}),
        ):
            try:
                attempt()
            except connector.DCPSupportMissingError as exc:
                assert cli.exit_code_for(exc) == cli.EXIT_MISSING_DEPENDENCY
                print(exc)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2, result.stdout
    assert lines[0].startswith("Verifying the DCP checkpoint s3://bucket/run/x-step=3.ckpt needs s3_dcp.py")
    assert lines[1].startswith("Listing the DCP checkpoint s3://bucket/run/x.ckpt needs s3_dcp.py")
    assert all(f"not beside s3_checkpoint_admin.py in {REPO}" in line for line in lines)
