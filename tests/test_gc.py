"""``s3-checkpoint-io gc``: what killed jobs leave (open multipart uploads, DCP checkpoints without ``.metadata``),
found by age on the store's clock and removed only with ``--yes``; the S3 primitives (`S3Utils`) and the policy
(`s3_checkpoint_admin.find_garbage`) under it. The age rule runs on SeaweedFS: moto reports every upload as
initiated in 2010."""

from __future__ import annotations

import datetime
import time
from typing import Any

import pytest

import s3_checkpoint_admin as admin
import s3_checkpoint_cli as cli
from s3_utils import CHECKSUM_SIDECAR_SUFFIX, S3Utils

MiB = 1024 * 1024


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def start_upload(s3_client: Any, bucket: str, key: str, parts: list[bytes]) -> str:
    upload_id = s3_client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    for number, body in enumerate(parts, 1):
        s3_client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body)
    return upload_id


def open_uploads(s3_client: Any, bucket: str) -> set[tuple[str, str]]:
    return {(u["Key"], u["UploadId"]) for u in s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])}


def keys(s3_client: Any, bucket: str) -> set[str]:
    return {o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket).get("Contents", [])}


def test_list_count_and_abort_uploads_under_a_slash_bounded_prefix(bucket: str, s3_client: Any, s3_server: Any) -> None:
    first = start_upload(s3_client, bucket, "run/a.ckpt", [b"x" * 10, b"y" * 20, b"z" * 30])
    second = start_upload(s3_client, bucket, "run/a.ckpt", [])  # a retried save: a second upload at one key
    nested = start_upload(s3_client, bucket, "run/sub/__0_0.distcp", [b"w" * 7])
    sibling = start_upload(s3_client, bucket, "run_old/b.ckpt", [b"v"])
    s3 = S3Utils(list_page_size=2)  # every listing takes several pages

    uploads = s3.list_multipart_uploads(f"s3://{bucket}/run")
    assert sorted((u.key, u.upload_id) for u in uploads) == sorted(
        [("run/a.ckpt", first), ("run/a.ckpt", second), ("run/sub/__0_0.distcp", nested)]
    )
    assert all(u.parts is None and isinstance(u.initiated, datetime.datetime) for u in uploads)
    counted = {u.upload_id: (u.parts, u.size, u.url) for u in s3.count_upload_parts(uploads)}
    assert counted == {
        first: (3, 60, f"s3://{bucket}/run/a.ckpt"),
        second: (0, 0, f"s3://{bucket}/run/a.ckpt"),
        nested: (1, 7, f"s3://{bucket}/run/sub/__0_0.distcp"),
    }

    assert s3.abort_multipart_upload(f"s3://{bucket}/run/a.ckpt", first) is True
    assert open_uploads(s3_client, bucket) == {
        ("run/a.ckpt", second),
        ("run/sub/__0_0.distcp", nested),
        ("run_old/b.ckpt", sibling),
    }
    # Gone meanwhile: left out of the count; aborting again is no error (SeaweedFS answers it like a real abort).
    assert [u.upload_id for u in s3.count_upload_parts(uploads)] == [
        u.upload_id for u in uploads if u.upload_id != first
    ]
    assert s3.abort_multipart_upload(f"s3://{bucket}/run/a.ckpt", first) is (s3_server.name == "seaweedfs")


def test_gc_dry_run_lists_then_yes_aborts_and_exit_codes(
    bucket: str, s3_client: Any, s3_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """moto dates every upload 2010: all are old there, which is enough for what gc prints and changes."""
    if s3_server.name != "moto":
        pytest.skip("needs uploads older than hours: moto's (SeaweedFS runs the age rule, in the next test)")
    old = start_upload(s3_client, bucket, "run/last.ckpt", [b"x" * MiB, b"y" * 100])
    sibling = start_upload(s3_client, bucket, "run_old/last.ckpt", [b"z"])
    s3_client.put_object(Bucket=bucket, Key="run/.s3ckpt-owner.json", Body=b"{}")  # e.g. a run's owner record

    code, out, err = run_cli(capsys, "gc", f"s3://{bucket}/run", "--older-than", "6h")
    assert code == cli.EXIT_OK, err
    line, summary = out.strip().splitlines()
    assert line.startswith("would abort") and f"s3://{bucket}/run/last.ckpt  (upload {old})" in line
    assert "2 parts" in line and "1.0 MiB" in line
    assert summary.startswith("dry run: 1 upload(s) (2 parts, 1.0 MiB) older than 6h under")
    assert "nothing was changed" in summary
    assert open_uploads(s3_client, bucket) == {("run/last.ckpt", old), ("run_old/last.ckpt", sibling)}

    code, out, err = run_cli(capsys, "gc", f"s3://{bucket}/run", "--older-than", "1d12h", "--yes")
    assert code == cli.EXIT_OK, err
    assert out.startswith("aborted") and "1 aborted or removed" in out
    assert open_uploads(s3_client, bucket) == {("run_old/last.ckpt", sibling)}
    assert keys(s3_client, bucket) == {"run/.s3ckpt-owner.json"}

    code, out, _ = run_cli(capsys, "gc", f"s3://{bucket}/run", "--older-than", "1d", "--yes")
    assert code == cli.EXIT_OK and out.startswith("0 upload(s) (0 parts, 0 B) older than 1d")
    for bad in ("0s", "6", "6x", "-1h", "h"):
        code, _, err = run_cli(capsys, "gc", f"s3://{bucket}/run", "--older-than", bad)
        assert code == cli.EXIT_USAGE and "--older-than" in err, bad
    code, _, err = run_cli(capsys, "gc", f"s3://{bucket}-missing/run", "--older-than", "1h")
    assert code == cli.EXIT_NOT_FOUND and f"No such bucket: s3://{bucket}-missing" in err


def test_gc_touches_only_what_is_older_than_the_threshold_on_seaweedfs(
    bucket: str, s3_client: Any, s3_server: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    if s3_server.name == "moto":
        pytest.skip("moto reports every upload as initiated in 2010: the age rule needs a store with real times")
    put = lambda key, body=b"x" * 100: s3_client.put_object(Bucket=bucket, Key=key, Body=body)  # noqa: E731
    # Before the pause: an abandoned upload, a DCP save that died before .metadata (its files plus another
    # object), a complete DCP checkpoint, a dead save that a running upload inside keeps alive, the sibling prefix.
    old = start_upload(s3_client, bucket, "run/last.ckpt", [b"x" * 50, b"y" * 50])
    start_upload(s3_client, bucket, "run_old/last.ckpt", [b"z"])
    for name in ("__0_0.distcp", "__1_0.distcp", "__1_0.distcp" + CHECKSUM_SIDECAR_SUFFIX, ".s3ckpt-owner.json"):
        put(f"run/dead-step=5.ckpt/{name}")
    for name in ("__0_0.distcp", ".metadata"):
        put(f"run/good-step=4.ckpt/{name}")
    put("run/busy-step=6.ckpt/__0_0.distcp")
    put("run/deeper/x-step=7.ckpt/__0_0.distcp")
    time.sleep(3.6)  # ages are whole seconds on SeaweedFS: 3.6 s apart is >= 3 s by its clock
    # After it: a running save's upload, a DCP save under way, and a new upload inside the older busy one.
    young = start_upload(s3_client, bucket, "run/step=8.ckpt", [b"w"])
    start_upload(s3_client, bucket, "run/busy-step=6.ckpt/__1_0.distcp", [])
    put("run/new-step=9.ckpt/__0_0.distcp")

    code, out, err = run_cli(capsys, "gc", f"s3://{bucket}/run", "--older-than", "2s", "--incomplete-dcp")
    assert code == cli.EXIT_OK, err
    lines = out.strip().splitlines()
    assert [line.split()[0:2] for line in lines[:-1]] == [["would", "abort"]] + [["would", "remove"]] * 2, out
    assert f"s3://{bucket}/run/last.ckpt  (upload {old})" in lines[0]
    assert f"s3://{bucket}/run/dead-step=5.ckpt/" in lines[1] and "3 files" in lines[1]
    assert "1 other object(s) kept" in lines[1]
    assert f"s3://{bucket}/run/deeper/x-step=7.ckpt/" in lines[2]
    assert "1 upload(s) (2 parts, 100 B) and 2 incomplete DCP checkpoint(s) (400 B) older than 2s" in lines[-1]
    assert "4 younger left alone" in lines[-1]  # 2 uploads; new-step=9, and busy-step=6 (an upload inside is young)

    # A save starts again in one of them between the listing and the removal: that one is left alone.
    garbage = admin.find_garbage(f"s3://{bucket}/run", datetime.timedelta(seconds=2), incomplete_checkpoints=True)
    put("run/deeper/x-step=7.ckpt/__1_0.distcp")
    s3 = S3Utils()
    assert [admin.remove_incomplete_checkpoint(c, s3_utils=s3) for c in garbage.checkpoints] == [True, False]
    assert s3.abort_multipart_upload(garbage.uploads[0].url, garbage.uploads[0].upload_id)

    assert {key for key, _ in open_uploads(s3_client, bucket)} == {
        "run/step=8.ckpt",
        "run/busy-step=6.ckpt/__1_0.distcp",
        "run_old/last.ckpt",
    }
    assert ("run/step=8.ckpt", young) in open_uploads(s3_client, bucket)
    assert keys(s3_client, bucket) == {
        "run/dead-step=5.ckpt/.s3ckpt-owner.json",  # not a file of the DCP save: never deleted
        "run/good-step=4.ckpt/__0_0.distcp",
        "run/good-step=4.ckpt/.metadata",
        "run/busy-step=6.ckpt/__0_0.distcp",
        "run/deeper/x-step=7.ckpt/__0_0.distcp",
        "run/deeper/x-step=7.ckpt/__1_0.distcp",
        "run/new-step=9.ckpt/__0_0.distcp",
    }
