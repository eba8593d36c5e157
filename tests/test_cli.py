"""The operator CLI (`s3_checkpoint_cli`): ls, verify, cp, rm, their exit codes and messages, in-process through
``main(argv)`` and as a real subprocess, against the local S3 servers of the suite."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from fault_proxy import Fault, FaultProxy, FaultRule
from optional_imports import DEMO_OPTIONAL_MODULES, HIDE_PREAMBLE, LIGHTNING_MODULES

import s3_checkpoint_admin as admin
import s3_checkpoint_cli as cli
from s3_utils import CHECKSUM_SIDECAR_SUFFIX, S3Utils

REPO = Path(__file__).resolve().parent.parent
BOTH_BUCKET_KINDS = pytest.mark.parametrize("bucket", ["general_purpose", "directory"], indirect=True)
"""Run a test on a general purpose bucket and on a directory bucket behind the directory-bucket proxy."""
HAVE_TQDM = importlib.util.find_spec("tqdm") is not None

# name -> size; written through S3Utils so that checksums are recorded as in real use.
RUN = {
    "demo-step=5.ckpt": 1000,
    "demo-step=10.ckpt": 2000,
    "demo-step=15.ckpt": 3000,
    "demo-step=20-end.ckpt": 4000,
    "last.ckpt": 4000,
    "demo-step=20-last.ckpt": 4000,
    "manual.ckpt": 500,
    "notes.txt": 10,
    "sub/demo-step=99.ckpt": 100,
}
SIBLING = {"run_old/demo-step=1.ckpt": 100}  # shares the "run" key prefix, must never be touched


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def write_object(url: str, size: int, seed: int = 0) -> bytes:
    data = bytes((seed + i) % 251 for i in range(size))
    with S3Utils().open_writer(url, 5) as writer:
        writer.write(data)
    return data


def keys(s3_client: Any, bucket: str) -> set[str]:
    pages = s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return {obj["Key"] for page in pages for obj in page.get("Contents", [])}


@pytest.fixture
def run_url(bucket: str) -> str:
    """``s3://<bucket>/run`` filled with `RUN`, and `SIBLING` beside it."""
    objects = {f"run/{name}": size for name, size in RUN.items()} | SIBLING
    for seed, (key, size) in enumerate(objects.items()):
        write_object(f"s3://{bucket}/{key}", size, seed=seed)
    return f"s3://{bucket}/run"


# ---- pure helpers ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("demo-step=10.ckpt", (10, "top-k")),
        ("epoch=0-step=7.ckpt", (7, "top-k")),
        ("last.ckpt", (None, "last")),
        ("last-v1.ckpt", (None, "last")),
        ("megatron--val_loss=1.2-step=300-consumed_samples=9-last.ckpt", (300, "last")),
        ("demo-step=20-end.ckpt", (20, "end")),
        ("end.ckpt", (None, "end")),
        ("backend.ckpt", (None, "end")),  # NeMo's *end.ckpt glob, which resume discovery applies too
        ("blast.ckpt", (None, "last")),
        ("global_step=5.ckpt", (None, "top-k")),
        ("step=3-step=12.ckpt", (12, "top-k")),
        ("dir/x-step=4.ckpt", (4, "top-k")),
        ("notes-step=3.txt", (3, "other")),
    ],
)
def test_classify_checkpoint(name: str, expected: tuple[int | None, str]) -> None:
    assert admin.classify_checkpoint(name) == expected


def test_help_documents_commands_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    for word in ("demo", "ls", "verify", "cp", "rm", "--endpoint-url", "--region", "exit codes"):
        assert word in out
    for code_line in ("0    success", "1    verification failed", "2    usage error", "3    not found", "4    S3"):
        assert code_line in out


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["ls"],
        ["frobnicate"],
        ["ls", "s3:/bucket/run"],  # collapsed by pathlib
        ["ls", "http://bucket/run"],
        ["ls", "s3://Bad_Bucket/run"],
        ["rm", "s3://bucket/run"],  # --keep-last is required
        ["rm", "s3://bucket/run", "--keep-last", "-1"],
        ["rm", "s3://bucket/run", "--keep-last", "two"],
        ["cp", "a.ckpt", "b.ckpt"],
        ["cp", "s3://bucket/a.ckpt", "s3://bucket/b.ckpt"],
        ["--max-attempts", "0", "ls", "s3://bucket/run"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, *argv)
    assert code == cli.EXIT_USAGE, (out, err)
    assert "error" in err
    assert out == ""


# ---- ls -------------------------------------------------------------------------------------------------------------


@BOTH_BUCKET_KINDS
def test_ls_lists_checkpoints_with_step_size_time_and_kind(run_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "ls", run_url)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["STEP", "SIZE", "LAST", "MODIFIED", "(UTC)", "SHARDS", "STATE", "KIND", "URL"]
    rows = [line.split() for line in lines[1:-1]]
    # stepped checkpoints by step, then the ones without a step; not recursive, *.ckpt only, no sidecars
    assert [(row[0], row[-2], row[-1].rpartition("/")[2]) for row in rows] == [
        ("5", "top-k", "demo-step=5.ckpt"),
        ("10", "top-k", "demo-step=10.ckpt"),
        ("15", "top-k", "demo-step=15.ckpt"),
        ("20", "end", "demo-step=20-end.ckpt"),
        ("20", "last", "demo-step=20-last.ckpt"),
        ("-", "last", "last.ckpt"),
        ("-", "top-k", "manual.ckpt"),
    ]
    expected = {f"{run_url}/{name}" for name in RUN if name.endswith(".ckpt") and "/" not in name}
    assert {row[-1] for row in rows} == expected
    sizes = {row[-1].rpartition("/")[2]: " ".join(row[1:3]) for row in rows}
    assert sizes["demo-step=5.ckpt"] == "1000 B"
    assert sizes["demo-step=15.ckpt"] == "2.9 KiB"
    assert lines[-1].startswith("7 checkpoint(s), ")


@BOTH_BUCKET_KINDS
def test_ls_json_recursive_and_all(run_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "ls", "--json", run_url)
    assert code == 0, err
    entries = json.loads(out)
    by_name = {entry["url"].removeprefix(run_url + "/"): entry for entry in entries}
    assert set(by_name) == {name for name in RUN if name.endswith(".ckpt") and "/" not in name}
    assert by_name["demo-step=10.ckpt"]["step"] == 10
    assert by_name["demo-step=10.ckpt"]["size"] == 2000
    assert by_name["demo-step=10.ckpt"]["kind"] == "top-k"
    assert by_name["last.ckpt"] == {**by_name["last.ckpt"], "step": None, "kind": "last"}
    assert by_name["last.ckpt"]["last_modified"].endswith("+00:00")

    _, out, _ = run_cli(capsys, "ls", "--json", "--recursive", run_url)
    assert "sub/demo-step=99.ckpt" in {e["url"].removeprefix(run_url + "/") for e in json.loads(out)}
    _, out, _ = run_cli(capsys, "ls", "--json", "--all", run_url)
    names = {e["url"].removeprefix(run_url + "/") for e in json.loads(out)}
    assert "notes.txt" in names
    assert {e["kind"] for e in json.loads(out) if e["url"].endswith("notes.txt")} == {"other"}
    assert not any(name.endswith(CHECKSUM_SIDECAR_SUFFIX) for name in names)
    assert not any("run_old" in e["url"] for e in json.loads(out))


@BOTH_BUCKET_KINDS
def test_ls_kinds_agree_with_resume_discovery(run_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """What ``ls`` calls last/end is exactly what the connector may resume from (or stop at)."""
    import connector

    resumable = {candidate.name: candidate.kind for candidate in connector.list_resume_candidates(run_url)}
    code, out, _ = run_cli(capsys, "ls", "--json", run_url)
    assert code == 0
    labelled = {entry["url"].rpartition("/")[2]: entry["kind"] for entry in json.loads(out)}
    assert {name: kind for name, kind in labelled.items() if kind != "top-k"} == resumable
    assert set(resumable) == {"last.ckpt", "demo-step=20-last.ckpt", "demo-step=20-end.ckpt"}


def test_ls_of_one_object_and_global_options_after_the_command(
    run_url: str, s3_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{run_url}/demo-step=10.ckpt"
    code, out, err = run_cli(capsys, "ls", url, "--endpoint-url", s3_server.endpoint_url, "--json")
    assert code == 0, err
    assert [(e["url"], e["step"], e["size"]) for e in json.loads(out)] == [(url, 10, 2000)]


def test_ls_nothing_found_exits_3(bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "ls", f"s3://{bucket}/empty")
    assert code == cli.EXIT_NOT_FOUND
    assert f"no checkpoints (*.ckpt) under s3://{bucket}/empty" in err
    assert out == ""


def test_missing_bucket_exits_3(s3_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "ls", "s3://s3ckpt-no-such-bucket-4242/run")
    assert code == cli.EXIT_NOT_FOUND
    assert "No such bucket: s3://s3ckpt-no-such-bucket-4242/run" in err


# ---- verify ---------------------------------------------------------------------------------------------------------


@BOTH_BUCKET_KINDS
def test_verify_one_checkpoint_and_a_prefix(run_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "verify", f"{run_url}/demo-step=10.ckpt")
    assert code == 0, (out, err)
    assert out.startswith(f"OK        {run_url}/demo-step=10.ckpt  2.0 KiB  CRC")

    code, out, err = run_cli(capsys, "verify", run_url)
    assert code == 0, (out, err)
    assert len([line for line in out.splitlines() if line.startswith("OK ")]) == 7
    assert all(line.endswith(("(s3)", "(sidecar)")) for line in out.splitlines() if line.startswith("OK "))


def test_verify_asks_s3_once_per_checkpoint_for_its_record(
    run_url: str, fault_proxy: FaultProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    """Per checkpoint: one HEAD and its ranged GET; the sidecar record is read only where the store keeps no
    checksum (the line then says "(sidecar)"). The download itself says which record it matched."""
    code, out, err = run_cli(capsys, "--endpoint-url", fault_proxy.endpoint_url, "verify", run_url)
    assert code == 0, (out, err)
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("OK ")}
    assert len(lines) == 7
    requests = [(r.method, urllib.parse.unquote(r.path)) for r in fault_proxy.requests]
    for url, line in lines.items():
        path = "/" + url.removeprefix("s3://")
        assert requests.count(("HEAD", path)) == 1, (url, requests)
        assert requests.count(("GET", path)) == 1, (url, requests)
        sidecar_reads = requests.count(("GET", path + CHECKSUM_SIDECAR_SUFFIX))
        assert sidecar_reads == (1 if line.endswith("(sidecar)") else 0), (line, requests)


def test_verify_missing_object_exits_3(bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "verify", f"s3://{bucket}/run/nope.ckpt")
    assert code == cli.EXIT_NOT_FOUND
    assert f"s3://{bucket}/run/nope.ckpt" in err


def test_verify_detects_corrupted_bytes_exit_1(
    run_url: str, fault_proxy: FaultProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    fault_proxy.add_rule(FaultRule(Fault.corrupt_body(offset=100), method="GET", path_regex=r"step=10\.ckpt$"))
    code, out, err = run_cli(capsys, "--endpoint-url", fault_proxy.endpoint_url, "verify", run_url)
    assert code == cli.EXIT_VERIFY_FAILED
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1
    assert f"{run_url}/demo-step=10.ckpt" in failed[0]
    assert "is corrupt" in failed[0]
    assert "1 of 7 checkpoint(s) failed verification" in err


def test_verify_object_without_recorded_checksum(
    bucket: str, s3_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    client = s3_server.client(request_checksum_calculation="when_required")
    client.put_object(Bucket=bucket, Key="run/foreign-step=1.ckpt", Body=b"x" * 100)
    head = client.head_object(Bucket=bucket, Key="run/foreign-step=1.ckpt", ChecksumMode="ENABLED")
    if any(name.startswith("Checksum") and name != "ChecksumType" for name in head):
        pytest.skip(f"{s3_server.name} records a checksum for every object by itself")
    url = f"s3://{bucket}/run/foreign-step=1.ckpt"
    code, out, _ = run_cli(capsys, "verify", url)
    assert code == cli.EXIT_VERIFY_FAILED
    assert "no checksum was recorded" in out
    code, out, _ = run_cli(capsys, "verify", "--allow-unverified", url)
    assert code == 0
    assert "size only" in out


# ---- cp -------------------------------------------------------------------------------------------------------------


@BOTH_BUCKET_KINDS
def test_cp_upload_and_download_round_trip_with_progress_bar(
    bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "model-step=3.ckpt"
    data = os.urandom(7 * 1024 * 1024 + 11)
    source.write_bytes(data)

    code, out, err = run_cli(capsys, "cp", "--progress", str(source), f"s3://{bucket}/up/")
    assert code == 0, err
    assert out.startswith(f"{source} -> s3://{bucket}/up/model-step=3.ckpt  7.0 MiB in ")
    assert ("100%" in err) == HAVE_TQDM  # tqdm's bar, on stderr

    download_dir = tmp_path / "down"
    download_dir.mkdir()
    code, out, err = run_cli(capsys, "cp", "--progress", f"s3://{bucket}/up/model-step=3.ckpt", str(download_dir))
    assert code == 0, err
    assert "verified" in out
    assert ("100%" in err) == HAVE_TQDM
    assert (download_dir / "model-step=3.ckpt").read_bytes() == data

    code, _, err = run_cli(capsys, "cp", "--no-progress", f"s3://{bucket}/up/model-step=3.ckpt", str(tmp_path / "x"))
    assert code == 0
    assert err == ""
    assert (tmp_path / "x").read_bytes() == data


def test_progress_bars_count_the_bytes_the_s3_layer_reports(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bars of cp (both ways) and verify are fed by the S3 layer's own progress callbacks, block by block and
    range by range as the bytes move (not once at the end), and stop at exactly the object's size; a hidden bar
    (``--no-progress``) takes the same updates and prints nothing."""
    bars: list[Any] = []

    class RecordingProgress(cli._Progress):
        def __init__(self, total: int, description: str, enabled: bool | None) -> None:
            super().__init__(total, description, enabled)
            self.total, self.updates = total, []
            bars.append(self)

        def update(self, n: int) -> None:
            self.updates.append(n)
            super().update(n)

    monkeypatch.setattr(cli, "_Progress", RecordingProgress)
    source = tmp_path / "m-step=1.ckpt"
    data = os.urandom(17 * 1024 * 1024 + 5)  # two 16 MiB blocks / ranges (the default chunk size)
    source.write_bytes(data)
    url = f"s3://{bucket}/p/m-step=1.ckpt"
    for argv in (
        ["cp", "--no-progress", str(source), url],
        ["cp", "--no-progress", url, str(tmp_path / "back.ckpt")],
        ["verify", "--no-progress", url],
    ):
        code, _, err = run_cli(capsys, *argv)
        assert code == 0, err
        assert err == ""
    assert (tmp_path / "back.ckpt").read_bytes() == data
    assert [bar.total for bar in bars] == [len(data)] * 3
    for bar in bars:
        assert sum(bar.updates) == len(data)
        assert len(bar.updates) == 2


def test_cp_works_without_tqdm(
    bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `from tqdm import tqdm` now raises ImportError
    source = tmp_path / "a.ckpt"
    source.write_bytes(b"abc" * 1000)
    code, _, err = run_cli(capsys, "cp", "--progress", str(source), f"s3://{bucket}/a.ckpt")
    assert code == 0, err
    code, _, err = run_cli(capsys, "cp", "--progress", f"s3://{bucket}/a.ckpt", str(tmp_path / "b.ckpt"))
    assert code == 0, err
    assert (tmp_path / "b.ckpt").read_bytes() == b"abc" * 1000
    assert "%" not in err


def test_cp_not_found_cases_exit_3(bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "cp", str(tmp_path / "missing.ckpt"), f"s3://{bucket}/x.ckpt")
    assert code == cli.EXIT_NOT_FOUND
    assert "no such file" in err

    code, _, err = run_cli(capsys, "cp", f"s3://{bucket}/missing.ckpt", str(tmp_path))
    assert code == cli.EXIT_NOT_FOUND
    assert f"s3://{bucket}/missing.ckpt" in err

    write_object(f"s3://{bucket}/dir/inner.ckpt", 10)
    code, _, err = run_cli(capsys, "cp", f"s3://{bucket}/dir", str(tmp_path))
    assert code == cli.EXIT_NOT_FOUND
    assert "it is a prefix holding objects" in err

    code, _, err = run_cli(capsys, "cp", f"s3://{bucket}/dir/inner.ckpt", str(tmp_path / "no" / "such" / "dir" / "f"))
    assert code == cli.EXIT_NOT_FOUND
    assert "destination directory does not exist" in err


def test_cp_download_of_corrupted_bytes_exits_1_and_writes_nothing(
    bucket: str, fault_proxy: FaultProxy, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_object(f"s3://{bucket}/c.ckpt", 5000)
    fault_proxy.add_rule(FaultRule(Fault.corrupt_body(offset=7), method="GET", path_regex=r"/c\.ckpt$"))
    code, out, err = run_cli(
        capsys, "--endpoint-url", fault_proxy.endpoint_url, "cp", f"s3://{bucket}/c.ckpt", str(tmp_path)
    )
    assert code == cli.EXIT_VERIFY_FAILED
    assert "is corrupt" in err
    assert out == ""
    assert list(tmp_path.iterdir()) == []


# ---- rm -------------------------------------------------------------------------------------------------------------


@BOTH_BUCKET_KINDS
def test_rm_keep_last_dry_run_then_prune(
    run_url: str, bucket: str, s3_client: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    before = keys(s3_client, bucket)
    code, out, err = run_cli(capsys, "rm", run_url, "--keep-last", "2", "--dry-run")
    assert code == 0, err
    assert keys(s3_client, bucket) == before
    would = [line.split()[-1] for line in out.splitlines() if line.startswith("would delete ")]
    assert would == [f"{run_url}/demo-step=5.ckpt"]
    assert out.splitlines()[-1] == f"dry run: 1 to delete, 6 to keep under {run_url}; nothing was deleted"

    code, out, err = run_cli(capsys, "rm", run_url, "--keep-last", "2")
    assert code == 0, err
    after = keys(s3_client, bucket)
    assert "run/demo-step=5.ckpt" not in after
    gone = {key.removesuffix(CHECKSUM_SIDECAR_SUFFIX) for key in before - after}
    assert gone == {"run/demo-step=5.ckpt"}  # its checksum record (if any) went with it
    assert {"run/demo-step=15.ckpt", "run/demo-step=10.ckpt"} <= after  # the 2 newest top-k by step
    protected = {"run/demo-step=20-end.ckpt", "run/last.ckpt", "run/demo-step=20-last.ckpt", "run/manual.ckpt"}
    assert protected <= after  # end, last and step-less checkpoints are never deleted
    assert {"run/notes.txt", "run/sub/demo-step=99.ckpt", "run_old/demo-step=1.ckpt"} <= after  # out of scope
    assert "(a last checkpoint)" in out
    assert "(an end checkpoint)" in out
    assert "(no step= in its name)" in out

    code, out, _ = run_cli(capsys, "rm", run_url, "--keep-last", "0")
    assert code == 0
    assert out.splitlines()[-1] == f"deleted 2, kept 4 checkpoint(s) under {run_url}"
    remaining = {k for k in keys(s3_client, bucket) if k.startswith("run/") and k.endswith(".ckpt")}
    assert remaining == protected | {"run/sub/demo-step=99.ckpt"}


@BOTH_BUCKET_KINDS
def test_rm_breaks_step_ties_by_modification_time(
    bucket: str, s3_client: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    write_object(f"s3://{bucket}/ties/b-step=7.ckpt", 10)
    time.sleep(1.1)  # S3 timestamps have one-second resolution
    write_object(f"s3://{bucket}/ties/a-step=7.ckpt", 10)
    write_object(f"s3://{bucket}/ties/a-step=3.ckpt", 10)
    code, _, err = run_cli(capsys, "rm", f"s3://{bucket}/ties", "--keep-last", "1")
    assert code == 0, err
    assert {k for k in keys(s3_client, bucket) if k.endswith(".ckpt")} == {"ties/a-step=7.ckpt"}


def test_rm_nothing_found_exits_3(bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "rm", f"s3://{bucket}/nothing", "--keep-last", "1")
    assert code == cli.EXIT_NOT_FOUND
    assert "no checkpoints" in err


# ---- sharded (DCP) checkpoints ---------------------------------------------------------------------------------------


def save_dcp(url: str, seed: int = 0) -> None:
    """A real DCP checkpoint at `url` (one process, two shards: thread_count=2), written by S3StorageWriter."""
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from s3_dcp import S3StorageWriter

    state = {"a": torch.arange(1000.0) + seed, "b": torch.full((500,), float(seed))}
    dcp.save(state, storage_writer=S3StorageWriter(url, thread_count=2), no_dist=True)


@pytest.fixture
def dcp_run_url(bucket: str, s3_client: Any) -> str:
    """``s3://<bucket>/dcp``: complete DCP checkpoints at steps 10, 20 (top-k) and 30 (last), an incomplete one at
    step 40 (its save died before .metadata), one single-file checkpoint, and a sibling prefix of step 10's."""
    base = f"s3://{bucket}/dcp"
    for seed, name in enumerate(("m-step=10.ckpt", "m-step=20.ckpt", "m-step=30-last.ckpt")):
        save_dcp(f"{base}/{name}", seed)
    s3_client.put_object(Bucket=bucket, Key="dcp/m-step=40-last.ckpt/__0_0.distcp", Body=b"x" * 100)
    s3_client.put_object(Bucket=bucket, Key="dcp/m-step=50.ckpt/__0_0.distcp", Body=b"x" * 10)  # a save under way
    write_object(f"{base}/file-step=5.ckpt", 300)
    write_object(f"{base}/m-step=10.ckpt_old/keep.bin", 10)
    return base


def dcp_sizes(s3_client: Any, bucket: str, key_prefix: str) -> tuple[int, int]:
    """(total size, number of .distcp objects) under `key_prefix` (ending in "/")."""
    pages = s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key_prefix)
    objects = [o for page in pages for o in page.get("Contents", []) if not o["Key"].endswith(CHECKSUM_SIDECAR_SUFFIX)]
    return sum(o["Size"] for o in objects), sum(o["Key"].endswith(".distcp") for o in objects)


@BOTH_BUCKET_KINDS
def test_ls_shows_a_dcp_checkpoint_as_one_entry(
    dcp_run_url: str, bucket: str, s3_client: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "ls", "--json", dcp_run_url)
    assert code == 0, err
    by_name = {entry["url"].removeprefix(dcp_run_url + "/"): entry for entry in json.loads(out)}
    assert set(by_name) == {
        "m-step=10.ckpt",
        "m-step=20.ckpt",
        "m-step=30-last.ckpt",
        "m-step=40-last.ckpt",
        "m-step=50.ckpt",
        "file-step=5.ckpt",
    }  # no shard, .metadata or m-step=10.ckpt_old/ entries
    size, shards = dcp_sizes(s3_client, bucket, "dcp/m-step=20.ckpt/")
    assert shards == 2
    assert by_name["m-step=20.ckpt"] == {
        **by_name["m-step=20.ckpt"],
        "format": "dcp",
        "shards": 2,
        "complete": True,
        "size": size,
        "step": 20,
        "kind": "top-k",
    }
    assert by_name["m-step=30-last.ckpt"]["kind"] == "last"
    assert by_name["m-step=40-last.ckpt"] == {**by_name["m-step=40-last.ckpt"], "shards": 1, "complete": False}
    assert by_name["file-step=5.ckpt"] == {
        **by_name["file-step=5.ckpt"],
        "format": "file",
        "shards": None,
        "complete": True,
    }

    code, out, err = run_cli(capsys, "ls", dcp_run_url)
    assert code == 0, err
    lines = out.splitlines()
    header_url = lines[0].index("URL")
    rows = {line.split()[-1].rpartition("/")[2]: line for line in lines[1:-1]}
    assert all(line.index(dcp_run_url) == header_url for line in rows.values())  # aligned with the header
    assert rows["m-step=20.ckpt"].split()[-4:-1] == ["2", "complete", "top-k"]
    assert rows["m-step=40-last.ckpt"].split()[-4:-1] == ["1", "incomplete", "last"]
    assert rows["file-step=5.ckpt"].split()[-4:-1] == ["-", "-", "top-k"]
    assert lines[-1].startswith("6 checkpoint(s), ") and "2 incomplete" in lines[-1]

    code, out, _ = run_cli(capsys, "ls", "--json", f"{dcp_run_url}/m-step=20.ckpt")  # the checkpoint itself
    assert code == 0
    assert [(e["url"], e["shards"], e["size"]) for e in json.loads(out)] == [(f"{dcp_run_url}/m-step=20.ckpt", 2, size)]


@BOTH_BUCKET_KINDS
def test_ls_kinds_of_dcp_checkpoints_agree_with_resume_discovery(
    dcp_run_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import connector

    candidates = {c.name: (c.kind, c.problem is None) for c in connector.list_resume_candidates(dcp_run_url)}
    _, out, _ = run_cli(capsys, "ls", "--json", dcp_run_url)
    listed = {e["url"].rpartition("/")[2]: (e["kind"], e["complete"]) for e in json.loads(out) if e["kind"] != "top-k"}
    assert listed == candidates == {"m-step=30-last.ckpt": ("last", True), "m-step=40-last.ckpt": ("last", False)}


def test_verify_checks_every_shard_and_item_of_a_dcp_checkpoint(
    dcp_run_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{dcp_run_url}/m-step=20.ckpt"
    code, out, err = run_cli(capsys, "verify", url)
    assert code == 0, (out, err)
    ok = [line.split()[1] for line in out.splitlines() if line.startswith("OK ")]
    assert {f"{url}/__0_0.distcp", f"{url}/__0_1.distcp", f"{url}/.metadata", f"{url}/.s3ckpt-items.json"} <= set(ok)
    assert out.splitlines()[-1].startswith(f"OK        {url}  ")
    assert "2 shard(s)" in out.splitlines()[-1] and "2 item(s) checked" in out.splitlines()[-1]

    code, out, err = run_cli(capsys, "verify", f"{dcp_run_url}/m-step=40-last.ckpt")
    assert code == cli.EXIT_VERIFY_FAILED
    assert f"{dcp_run_url}/m-step=40-last.ckpt/.metadata does not exist" in out
    assert "1 of 1 checkpoint(s) failed verification" in err


def test_verify_finds_a_corrupt_dcp_shard(
    dcp_run_url: str, fault_proxy: FaultProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    fault_proxy.add_rule(
        FaultRule(Fault.corrupt_body(offset=10), method="GET", path_regex=r"step=20\.ckpt/__0_1\.distcp$")
    )
    url = f"{dcp_run_url}/m-step=20.ckpt"
    code, out, err = run_cli(capsys, "--endpoint-url", fault_proxy.endpoint_url, "verify", dcp_run_url)
    assert code == cli.EXIT_VERIFY_FAILED, (out, err)
    failed = [line for line in out.splitlines() if line.startswith("FAILED")]
    assert any(f"{url}/__0_1.distcp is corrupt" in line for line in failed), out
    assert any(line.startswith(f"FAILED    {url}: DCP checkpoint, 2 shard(s)") for line in failed), out
    assert "3 of 6 checkpoint(s) failed verification" in err  # step 20 and the incomplete steps 40 and 50


def test_verify_finds_a_dcp_shard_replaced_after_the_save(
    dcp_run_url: str, bucket: str, s3_client: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{dcp_run_url}/m-step=10.ckpt"
    write_object(f"{url}/__0_0.distcp", 64, seed=9)  # checksummed, so only the item record can tell
    code, out, _ = run_cli(capsys, "verify", url)
    assert code == cli.EXIT_VERIFY_FAILED
    assert f"{url}/__0_0.distcp was replaced after the checkpoint was saved" in out


def test_verify_checks_each_item_against_its_recorded_checksum(
    dcp_run_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{dcp_run_url}/m-step=10.ckpt"
    record_url = f"{url}/.s3ckpt-items.json"
    with S3Utils().download_to_memory(record_url) as downloaded:
        record = json.loads(downloaded.read_all())
    shard, entry = sorted(record["files"].items())[0]
    offset = sorted(entry["items"], key=int)[0]
    entry["items"][offset][1] ^= 1  # the shard is intact; its first item no longer matches the record
    data = json.dumps(record).encode()
    with S3Utils().open_writer(record_url, 5) as writer:
        writer.write(data)
    code, out, _ = run_cli(capsys, "verify", url)
    assert code == cli.EXIT_VERIFY_FAILED
    assert f"{url}/{shard} is corrupt: bytes {offset}-" in out


@BOTH_BUCKET_KINDS
def test_rm_keep_last_removes_a_dcp_checkpoint_as_one(
    dcp_run_url: str, bucket: str, s3_client: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "rm", dcp_run_url, "--keep-last", "1", "--dry-run")
    assert code == 0, err
    would = [line.split()[-1] for line in out.splitlines() if line.startswith("would delete ")]
    assert would == [f"{dcp_run_url}/file-step=5.ckpt", f"{dcp_run_url}/m-step=10.ckpt"]

    code, out, err = run_cli(capsys, "rm", dcp_run_url, "--keep-last", "1")
    assert code == 0, err
    after = keys(s3_client, bucket)
    assert not any(key.startswith("dcp/m-step=10.ckpt/") for key in after)  # every shard, record and .metadata
    assert "dcp/m-step=10.ckpt_old/keep.bin" in after  # /-bounded
    assert "dcp/m-step=20.ckpt/.metadata" in after and "dcp/m-step=30-last.ckpt/.metadata" in after
    assert "dcp/m-step=40-last.ckpt/__0_0.distcp" in after  # a last checkpoint, even incomplete, is never pruned
    assert "dcp/m-step=50.ckpt/__0_0.distcp" in after  # the newest step, but incomplete: neither kept nor pruned
    assert f"{dcp_run_url}/m-step=50.ckpt  (no .metadata: its save may still be running)" in out
    assert out.splitlines()[-1] == f"deleted 2, kept 4 checkpoint(s) under {dcp_run_url}"


# ---- S3 errors ------------------------------------------------------------------------------------------------------


def test_access_denied_exits_4_with_hint(
    run_url: str, fault_proxy: FaultProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    fault_proxy.add_rule(FaultRule(Fault.status(403), method="GET"))
    code, out, err = run_cli(capsys, "--endpoint-url", fault_proxy.endpoint_url, "ls", run_url)
    assert code == cli.EXIT_S3_ERROR
    assert out == ""
    assert "AccessDenied" in err
    assert "check the credentials" in err
    assert err.startswith("s3-checkpoint-io: error: ")


def test_unreachable_endpoint_exits_4(s3_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, _, err = run_cli(
        capsys, "--endpoint-url", f"http://127.0.0.1:{port}", "--max-attempts", "1", "ls", "s3://bucket/run"
    )
    assert code == cli.EXIT_S3_ERROR
    assert "Could not connect" in err


# ---- as a real process ----------------------------------------------------------------------------------------------


def _cli_env(s3_server: Any) -> dict[str, str]:
    env = {**os.environ, **s3_server.env()}  # the suite's AWS isolation plus the server's address and keys
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def test_runs_as_a_subprocess_with_exit_codes(run_url: str, s3_server: Any, tmp_path: Path) -> None:
    env = _cli_env(s3_server)

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "s3_checkpoint_cli", *argv]
        return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)

    result = run("ls", "--json", run_url)
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)) == 7

    result = run("verify", f"{run_url}/missing.ckpt")
    assert result.returncode == cli.EXIT_NOT_FOUND
    assert result.stdout == ""
    assert result.stderr.startswith("s3-checkpoint-io: error: No such object:")
    assert "Traceback" not in result.stderr

    result = run("rm", run_url)
    assert result.returncode == cli.EXIT_USAGE
    assert "--keep-last" in result.stderr


def test_console_script(run_url: str, s3_server: Any, tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "s3-checkpoint-io"
    if not script.exists():
        pytest.skip("the package is not installed in this environment (pip install -e .): no console script")
    result = subprocess.run(
        [str(script), "ls", run_url], env=_cli_env(s3_server), cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "demo-step=15.ckpt" in result.stdout


ALL_EXTRAS = DEMO_OPTIONAL_MODULES


@pytest.mark.parametrize(
    ("hidden", "argv", "expected"),
    [
        (ALL_EXTRAS, ["ls", "s3://bucket/run"], 'pip install "s3-checkpoint-io[s3]"'),
        (ALL_EXTRAS, ["verify", "s3://bucket/run/x.ckpt"], 'pip install "s3-checkpoint-io[s3]"'),
        (ALL_EXTRAS, ["demo"], "pip install torch"),
        (LIGHTNING_MODULES, ["demo"], 'pip install "s3-checkpoint-io[lightning]"'),
        (("moto",), ["demo"], "moto[server]"),
    ],
    ids=["ls", "verify", "demo-torch", "demo-lightning", "demo-moto"],
)
def test_import_needs_no_extra_and_a_missing_one_exits_5(
    hidden: tuple[str, ...], argv: list[str], expected: str, tmp_path: Path
) -> None:
    script = HIDE_PREAMBLE.format(hidden=set(hidden)) + textwrap.dedent(
        """
        import s3_checkpoint_cli
        assert s3_checkpoint_cli.main(["--help"]) == 0
        sys.exit(s3_checkpoint_cli.main(sys.argv[1:]))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", script, *argv], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == cli.EXIT_MISSING_DEPENDENCY, result.stderr
    assert "Traceback" not in result.stderr
    assert expected in result.stderr
    assert result.stderr.startswith("s3-checkpoint-io: error: ")
