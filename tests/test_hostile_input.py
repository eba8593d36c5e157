"""Hostile and malformed input to every public entry point: a specific exception that names the input, never a
silent wrong answer, never a request for an input that cannot be valid.

What "a clear error" means here:

* malformed S3 URLs (``s3:/x``, ``s3://``, ``s3:///k``, ``http://...``, invalid buckets, keys over 1024 UTF-8 bytes or
  not encodable) raise ``ValueError`` whose message contains ``repr()`` of the input, before any network access;
  ``None``, ints and bytes raise ``TypeError`` naming the type;
* a URL that names a bucket or a "directory" (``s3://b``, ``s3://b/dir/``) where an object is expected raises
  ``IsADirectoryError``; a key that only exists as a prefix raises ``FileNotFoundError``; both name the URL;
* an object that is not a checkpoint (empty, random bytes, text, a truncated checkpoint, a plain pickle) raises
  ``pickle.UnpicklingError`` (torch's own type for "cannot unpickle this", which is also what a ``weights_only``
  refusal raises), whose message names the URL (and says "empty" for a 0-byte object), the torch error chained;
* a checksum record that cannot be read raises ``ChecksumMismatchError`` naming the URL: a damaged record never
  disables verification, and never surfaces as a bare ``UnicodeDecodeError``/``KeyError``;
* a half-S3 string (``s3:/b/k``, ``S3://b/k``, ``s3:b/k``) or another URL scheme given to `S3CheckpointIO` or to
  resume discovery raises ``ValueError``: it is never taken as a local path (a checkpoint silently written to the
  container's disk is a lost checkpoint).

Keys with unicode, spaces, ``=``, ``+``, ``%``, ``#``, ``?`` and other specials must work end to end.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import tempfile
import traceback
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from s3_servers import S3Endpoint

import connector
import s3_checkpoint_cli as cli
from s3_checkpoint_io import S3CheckpointIO
from s3_dirpath_utils import parse_s3_url
from s3_utils import CHECKSUM_SIDECAR_SUFFIX, OWNER_RECORD_NAME, ChecksumMismatchError, RetryPolicy, S3Utils

MiB = 1024 * 1024
FAST = RetryPolicy(max_attempts=3, max_elapsed_s=5.0, initial_backoff_s=0.01, max_backoff_s=0.05)


class NetworkTouchedError(AssertionError):
    """Raised by `NoNetwork` when code under test reaches for the S3 client."""


class NoNetwork:
    """A stand-in S3 client: any use fails the test, proving that validation happened before the network."""

    def __getattr__(self, name: str) -> Any:
        raise NetworkTouchedError(f"the S3 client was used ({name}) for an input that should have been rejected")


def offline_utils() -> S3Utils:
    return S3Utils(client=NoNetwork(), retry_policy=FAST)


def rendered(exc: BaseException) -> str:
    """What a traceback's last lines show for `exc`: type, message and notes."""
    return "".join(traceback.format_exception_only(type(exc), exc))


def checkpoint_bytes(checkpoint: Any, **kwargs: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer, **kwargs)
    return buffer.getvalue()


# ---- malformed URLs, offline ----------------------------------------------------------------------------------------

_UNWRITTEN = os.path.join(tempfile.gettempdir(), f"s3ckpt-never-written-{uuid.uuid4().hex}")

#: Every public S3Utils method that takes a URL, called with `url` in that position.
URL_METHODS: dict[str, Callable[[S3Utils, Any], Any]] = {
    "head_object": lambda u, url: u.head_object(url),
    "list_objects": lambda u, url: u.list_objects(url),
    "list_objects_with_key_prefix": lambda u, url: u.list_objects_with_key_prefix(url),
    "s3_path_exists": lambda u, url: u.s3_path_exists(url, match_directory=True),
    "find_files_with_suffix": lambda u, url: u.find_files_with_suffix(url, ".ckpt", return_key_only=False),
    "remove_object": lambda u, url: u.remove_object(url),
    "remove_objects_with_prefix": lambda u, url: u.remove_objects_with_prefix(url),
    "open_writer": lambda u, url: u.open_writer(url, 5, 1),
    "upload_file_stream_to_s3": lambda u, url: u.upload_file_stream_to_s3(io.BytesIO(b"x"), url, 5, 1),
    "upload_file": lambda u, url: u.upload_file(__file__, url, 5, 1),
    "download_to_memory": lambda u, url: u.download_to_memory(url),
    "download_s3_file_to_stream": lambda u, url: u.download_s3_file_to_stream(url),
    "download_s3_file_to_path": lambda u, url: u.download_s3_file_to_path(url, _UNWRITTEN),
    "parse_s3_url": lambda u, url: u.parse_s3_url(url),
}

MALFORMED_URLS: list[Any] = [
    "s3:/bucket/k.ckpt",  # collapsed by pathlib, as a str
    "s3:bucket/k.ckpt",
    "s3://",
    "s3:///k.ckpt",
    "s3:////k.ckpt",
    "http://bucket/k.ckpt",
    "S3://bucket/k.ckpt",
    "",
    "bucket/k.ckpt",
    "s3://Bad_Bucket/k.ckpt",
    "s3://ab/k.ckpt",
    "s3://" + "b" * 64 + "/k.ckpt",
    "s3://bucket..name/k.ckpt",
    "s3://192.168.1.10/k.ckpt",
    "s3://-bucket/k.ckpt",
    "s3://buck et/k.ckpt",
    "s3://bucket\n/k.ckpt",
    "s3://bucket/" + "k" * 1025,
    "s3://bucket/" + "é" * 513,  # 1026 bytes of UTF-8
    "s3://bucket/\ud800.ckpt",  # lone surrogate: not UTF-8
    Path("relative/k.ckpt"),
    PurePosixPath("/abs/k.ckpt"),
]
WRONG_TYPES: list[Any] = [None, 5, 3.5, b"s3://bucket/k.ckpt", ["s3://bucket/k.ckpt"]]


@pytest.mark.parametrize("method", sorted(URL_METHODS))
def test_s3utils_methods_reject_malformed_urls_before_the_network(method: str) -> None:
    """Every URL-taking method: ValueError naming the input, TypeError naming the type; the client is never used."""
    problems = []
    for url in MALFORMED_URLS + WRONG_TYPES:
        expected = TypeError if url in WRONG_TYPES else ValueError
        try:
            URL_METHODS[method](offline_utils(), url)
        except expected as exc:
            shown = repr(url) if expected is ValueError else type(url).__name__
            if shown[:60] not in str(exc):
                problems.append(f"{url!r:.50}: message does not name it: {exc}")
        except BaseException as exc:
            problems.append(f"{url!r:.50}: {type(exc).__name__}: {exc}"[:300])
        else:
            problems.append(f"{url!r:.50}: accepted")
    assert not problems, "\n".join(problems)


GARBAGE = st.one_of(
    st.none(),
    st.integers(),
    st.floats(allow_nan=True),
    st.binary(max_size=30),
    st.text(max_size=80),
    st.text(max_size=60).map(lambda text: "s3://" + text),
    st.text(max_size=60).map(lambda text: "s3:/" + text),
    st.text(max_size=60).map(lambda text: "s3://" + text + "/"),
    st.builds(PurePosixPath, st.text(min_size=1, max_size=30)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(method=st.sampled_from(sorted(URL_METHODS)), value=GARBAGE)
def test_s3utils_methods_only_raise_documented_errors_for_garbage(method: str, value: Any) -> None:
    """Property: for any input, a URL method raises only ValueError / TypeError / FileNotFoundError /
    IsADirectoryError, and reaches for the network only when the input is a valid S3 URL."""
    try:
        result = URL_METHODS[method](offline_utils(), value)
    except NetworkTouchedError:
        parse_s3_url(value)  # only a valid URL may get this far
        return
    except (ValueError, TypeError, FileNotFoundError, IsADirectoryError):
        return
    if hasattr(result, "abort"):  # open_writer validated the URL and made no request yet
        result.abort()
        parse_s3_url(value)
        return
    assert method in {"parse_s3_url"}, f"{method}({value!r}) returned {result!r} without touching the network"


def test_s3checkpointio_rejects_malformed_s3_urls_before_the_network(tmp_path: Path) -> None:
    plugin = S3CheckpointIO(chunk_size_MB=5, s3_utils=offline_utils())
    calls: dict[str, Callable[[Any], Any]] = {
        "save": lambda url: plugin.save_checkpoint({"w": torch.zeros(2)}, url),
        "load": lambda url: plugin.load_checkpoint(url),
        "remove": lambda url: plugin.remove_checkpoint(url),
    }
    inputs = [url for url in MALFORMED_URLS if isinstance(url, str) and url.startswith("s3://")]
    for name, call in calls.items():
        for url in inputs:
            with pytest.raises(ValueError) as raised:
                call(url)
            assert repr(url)[:60] in str(raised.value), (name, url)
        for wrong in (None, 5, b"s3://bucket/k.ckpt"):
            with pytest.raises(TypeError):
                call(wrong)


HALF_S3 = ["s3:/bucket/run/k.ckpt", "S3://bucket/run/k.ckpt", "s3:bucket/run/k.ckpt", "S3:/bucket/run"]
OTHER_SCHEMES = ["http://bucket/run/k.ckpt", "gs://bucket/run/k.ckpt", "file:///tmp/k.ckpt"]
HALF_S3_IS_LOCAL = (
    "defect: S3CheckpointIO._as_path_string (and connector's discovery) treat a str that is not exactly s3://... as a "
    "local path: 's3:/b/k', 'S3://b/k', 'http://b/k' silently save to the local disk (fix: reject str paths starting "
    "with 's3:' or a URL scheme with ValueError)"
)


@pytest.mark.parametrize("operation", ["save", "load", "remove"])
def test_half_s3_and_other_url_schemes_are_never_local_paths(
    operation: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    plugin = S3CheckpointIO(chunk_size_MB=5, s3_utils=offline_utils())
    for url in [*HALF_S3, *OTHER_SCHEMES]:
        with pytest.raises(ValueError) as raised:
            if operation == "save":
                plugin.save_checkpoint({"w": torch.zeros(2)}, url)
            elif operation == "load":
                plugin.load_checkpoint(url)
            else:
                plugin.remove_checkpoint(url)
        assert url in str(raised.value)
    assert list(tmp_path.iterdir()) == [], "nothing may be written to the local disk"


@pytest.mark.parametrize("url", HALF_S3 + OTHER_SCHEMES[:1])
def test_resume_discovery_never_takes_a_half_s3_url_for_a_local_directory(url: str) -> None:
    """With resume_ignore_no_checkpoint=True a typo would otherwise mean "train from scratch", silently."""
    with pytest.raises(ValueError) as raised:
        connector.find_resume_checkpoint(url, resume_ignore_no_checkpoint=True, s3_utils=offline_utils())
    assert url in str(raised.value)


@pytest.mark.parametrize("url", ["s3://", "s3://Bad_Bucket/run", "s3://bucket/" + "k" * 1025, "s3:///run"])
def test_resume_discovery_rejects_malformed_s3_urls(url: str) -> None:
    for call in (connector.find_resume_checkpoint, connector.list_resume_candidates):
        with pytest.raises(ValueError):
            call(url, s3_utils=offline_utils())
    for bad in (None, 5):
        with pytest.raises((TypeError, ValueError)):
            connector.find_resume_checkpoint(bad, s3_utils=offline_utils())


CTOR_CASES: list[tuple[dict[str, Any], type[Exception]]] = [
    ({"dirpath": 5}, TypeError),
    ({"chunk_size_MB": 4.99}, ValueError),
    ({"chunk_size_MB": 0}, ValueError),
    ({"chunk_size_MB": -5}, ValueError),
    ({"chunk_size_MB": "64"}, TypeError),
    ({"chunk_size_MB": None}, TypeError),
    ({"max_read_concurrency": 0}, ValueError),
    ({"max_write_concurrency": -1}, ValueError),
    ({"max_saves_in_flight": 0}, ValueError),
    ({"max_write_concurrency": "10"}, TypeError),
]
CTOR_LATE_CASES: list[tuple[dict[str, Any], type[Exception]]] = [
    ({"chunk_size_MB": math.nan}, ValueError),
    ({"chunk_size_MB": math.inf}, ValueError),
    ({"checksum_algorithm": "md5"}, ValueError),
    ({"retry_policy": "fast"}, TypeError),
]


@pytest.mark.parametrize(("kwargs", "expected"), CTOR_CASES, ids=[str(case[0]) for case in CTOR_CASES])
def test_constructor_rejects_bad_arguments(kwargs: dict[str, Any], expected: type[Exception]) -> None:
    with pytest.raises(expected):
        S3CheckpointIO(**kwargs)


@pytest.mark.parametrize(("kwargs", "expected"), CTOR_LATE_CASES, ids=[str(case[0]) for case in CTOR_LATE_CASES])
def test_constructor_rejects_arguments_that_would_only_fail_at_the_first_save(
    kwargs: dict[str, Any], expected: type[Exception]
) -> None:
    with pytest.raises(expected):
        S3CheckpointIO(**kwargs)


@pytest.mark.parametrize(
    "argv",
    [
        ["ls", "s3://"],
        ["ls", "s3:///run"],
        ["verify", "s3:/bucket/run/x.ckpt"],
        ["verify", "S3://bucket/run"],
        ["cp", "s3://bucket/" + "k" * 1025, "out.ckpt"],
        ["cp", "in.ckpt", "s3://Bad_Bucket/x.ckpt"],
        ["rm", "s3://ab/run", "--keep-last", "1"],
        ["rm", "http://bucket/run", "--keep-last", "1"],
    ],
)
def test_cli_rejects_malformed_urls_with_one_line_and_exit_2(
    argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.ckpt").write_bytes(b"x")
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == cli.EXIT_USAGE, (out, err)
    assert out == ""
    assert err.startswith("s3-checkpoint-io: error:") and "Traceback" not in err
    bad = next(arg for arg in argv if arg.lower().startswith(("s3:", "http")))
    assert repr(bad)[:60] in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.ckpt"]


# ---- keys with unicode and special characters, end to end ------------------------------------------------------------

SPECIAL_KEYS = [
    "ünïcødé/模型/чекпойнт.ckpt",
    "with space/and  two  spaces .ckpt",
    "eq=1/epoch=2-step=10-val_loss=0.5.ckpt",
    "plus+sign/a+b.ckpt",
    "percent%/100%25 done%2F.ckpt",
    "hash#/x#1.ckpt",
    "question?/what?now.ckpt",
    "amp&tilde~/a&b~c!'()*$@,;:.ckpt",
    "emoji-🚀/🔥.ckpt",
]


@pytest.fixture
def direct_plugin(s3_server: S3Endpoint) -> Iterator[S3CheckpointIO]:
    """`S3CheckpointIO` talking to the server directly (endpoint from the session's environment)."""
    plugin = S3CheckpointIO(chunk_size_MB=5, max_write_concurrency=2, retry_policy=FAST)
    yield plugin
    plugin.teardown()


@pytest.mark.parametrize("key", SPECIAL_KEYS)
def test_special_character_keys_work_end_to_end(
    key: str, direct_plugin: S3CheckpointIO, s3_client: Any, bucket: str
) -> None:
    url = f"s3://{bucket}/{key}"
    checkpoint = {"w": torch.arange(1000.0), "name": key}
    direct_plugin.save_checkpoint(checkpoint, url)
    loaded = direct_plugin.load_checkpoint(url)
    assert torch.equal(loaded["w"], checkpoint["w"]) and loaded["name"] == key
    utils = direct_plugin.s3
    assert utils.s3_path_exists(url)
    parent = url.rsplit("/", 1)[0]
    assert [obj.key for obj in utils.list_objects(parent)] == [key]
    assert utils.find_files_with_suffix(parent, ".ckpt", return_key_only=False) == [url]
    assert utils.head_object(url).key == key
    direct_plugin.remove_checkpoint(url)
    assert not utils.s3_path_exists(url)
    left = [obj["Key"] for obj in s3_client.list_objects_v2(Bucket=bucket).get("Contents", [])]
    assert left == [key.rsplit("/", 1)[0] + "/" + OWNER_RECORD_NAME], "checksum record left behind"  # the run's hold


def test_special_character_prefix_multipart_resume_and_cli(
    direct_plugin: S3CheckpointIO, bucket: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A multipart checkpoint under a prefix full of specials: saved, found by resume discovery, listed and verified
    by the CLI, loaded bit-identical."""
    base = f"s3://{bucket}/rün 1/a=b+c%d#e?f"
    url = f"{base}/model-step=7-last.ckpt"
    checkpoint = {"w": torch.randn(6 * MiB // 4, generator=torch.Generator().manual_seed(3))}
    direct_plugin.save_checkpoint(checkpoint, url)
    assert torch.equal(direct_plugin.load_checkpoint(url)["w"], checkpoint["w"])
    assert connector.find_resume_checkpoint(base, s3_utils=direct_plugin.s3) == url
    assert cli.main(["ls", "--json", base]) == cli.EXIT_OK
    assert [entry["url"] for entry in json.loads(capsys.readouterr().out)] == [url]
    assert cli.main(["verify", url]) == cli.EXIT_OK


#: A key of exactly 1024 UTF-8 bytes (S3's limit) in path segments of at most 250 bytes (SeaweedFS, like most file
#: systems, refuses a single segment over 255 bytes).
LONGEST_KEY = "/".join(["é" * 125] * 4) + "/" + "k" * 20


@pytest.mark.parametrize("mib", [0.01, 6], ids=["one-put", "multipart"])
def test_longest_key_saves_and_loads_or_fails_before_writing(
    mib: float, direct_plugin: S3CheckpointIO, s3_client: Any, bucket: str
) -> None:
    """A key of exactly 1024 UTF-8 bytes: it works, or the save fails without leaving anything behind."""
    assert len(LONGEST_KEY.encode()) == 1024
    url = f"s3://{bucket}/{LONGEST_KEY}"
    checkpoint = {"w": torch.randn(int(mib * MiB) // 4)}
    try:
        direct_plugin.save_checkpoint(checkpoint, url)
    except Exception:
        listed = s3_client.list_objects_v2(Bucket=bucket).get("KeyCount", 0)
        assert listed == 0, "a failed save must not leave an object behind"
        assert s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []
        return
    assert torch.equal(direct_plugin.load_checkpoint(url)["w"], checkpoint["w"])


# ---- objects that are not checkpoints --------------------------------------------------------------------------------

NOT_CHECKPOINTS: dict[str, Callable[[], bytes]] = {
    "empty": lambda: b"",
    "random-bytes": lambda: bytes(range(256)) * 64,
    "text": lambda: b"hello world\n",
    "json": lambda: b'{"state_dict": {}}',
    "truncated-checkpoint": lambda: checkpoint_bytes({"w": torch.ones(1000)})[:2000],
    "plain-pickle": lambda: pickle.dumps({"w": [1.0, 2.0]}),
}


@pytest.mark.parametrize("kind", sorted(NOT_CHECKPOINTS))
def test_loading_an_object_that_is_not_a_checkpoint_names_the_url(
    kind: str, direct_plugin: S3CheckpointIO, s3_client: Any, bucket: str
) -> None:
    s3_client.put_object(Bucket=bucket, Key=f"run/{kind}.ckpt", Body=NOT_CHECKPOINTS[kind]())
    url = f"s3://{bucket}/run/{kind}.ckpt"
    with pytest.raises(pickle.UnpicklingError) as raised:
        direct_plugin.load_checkpoint(url)
    message = rendered(raised.value)
    assert url in message
    if kind == "empty":
        assert "empty" in message or "0 bytes" in message


def test_loading_a_legacy_format_checkpoint_still_works(
    direct_plugin: S3CheckpointIO, s3_client: Any, bucket: str
) -> None:
    """The non-zip format cannot be memory-mapped: load_checkpoint falls back to a plain load."""
    data = checkpoint_bytes({"w": torch.arange(5.0)}, _use_new_zipfile_serialization=False)
    s3_client.put_object(Bucket=bucket, Key="run/legacy.ckpt", Body=data)
    assert torch.equal(direct_plugin.load_checkpoint(f"s3://{bucket}/run/legacy.ckpt")["w"], torch.arange(5.0))


# ---- a directory where an object is expected -------------------------------------------------------------------------


@pytest.fixture
def tree(s3_client: Any, bucket: str) -> str:
    """``dir/a.ckpt`` and ``dir/sub/b.ckpt``: ``dir`` and ``dir/`` exist only as prefixes."""
    for key in ("dir/a.ckpt", "dir/sub/b.ckpt"):
        s3_client.put_object(Bucket=bucket, Key=key, Body=checkpoint_bytes({"k": key}))
    return bucket


@pytest.mark.parametrize(
    ("suffix", "expected"),
    [
        pytest.param("", IsADirectoryError),
        pytest.param("/", IsADirectoryError),
        pytest.param("/dir/", IsADirectoryError),
        pytest.param("/dir", FileNotFoundError),
        pytest.param("/dir/sub", FileNotFoundError),
    ],
)
def test_loading_a_directory_is_a_specific_error_naming_the_url(
    suffix: str, expected: type[Exception], direct_plugin: S3CheckpointIO, tree: str
) -> None:
    url = f"s3://{tree}{suffix}"
    with pytest.raises(expected) as raised:
        direct_plugin.load_checkpoint(url)
    assert url in rendered(raised.value)


@pytest.mark.parametrize("suffix", ["", "/", "/dir/"])
def test_saving_to_a_directory_is_refused_and_removing_one_deletes_nothing(
    suffix: str, direct_plugin: S3CheckpointIO, s3_client: Any, tree: str
) -> None:
    url = f"s3://{tree}{suffix}"
    with pytest.raises(IsADirectoryError) as raised:
        direct_plugin.save_checkpoint({"w": torch.ones(2)}, url)
    assert url in str(raised.value)
    with contextlib.suppress(IsADirectoryError):  # a bucket is refused; "dir/" names at most a folder marker
        direct_plugin.remove_checkpoint(url)
    keys = sorted(obj["Key"] for obj in s3_client.list_objects_v2(Bucket=tree)["Contents"])
    assert keys == ["dir/a.ckpt", "dir/sub/b.ckpt"]


def test_download_into_an_existing_directory_fails_and_leaves_no_partial_file(
    direct_plugin: S3CheckpointIO, tree: str, tmp_path: Path
) -> None:
    target = tmp_path / "existing"
    (target / "inside").mkdir(parents=True)
    with pytest.raises(IsADirectoryError):
        direct_plugin.s3.download_s3_file_to_path(f"s3://{tree}/dir/a.ckpt", target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]
    assert [p.name for p in target.iterdir()] == ["inside"]


# ---- damaged checksum records ----------------------------------------------------------------------------------------

SIDECARS: dict[str, Callable[[int, str], bytes]] = {
    "binary-garbage": lambda size, etag: b"\x84\x00garbage",
    "json-list": lambda size, etag: b"[1, 2]",
    "json-null": lambda size, etag: b"null",
    "unknown-algorithm": lambda size, etag: json.dumps(
        {"algorithm": "MD5", "checksum": "AAAA", "size": size, "etag": etag}
    ).encode(),
    "no-checksum": lambda size, etag: json.dumps({"algorithm": "CRC32", "size": size, "etag": etag}).encode(),
    "wrong-checksum": lambda size, etag: json.dumps(
        {"algorithm": "CRC32", "checksum": "AAAAAA==", "size": size, "etag": etag}
    ).encode(),
}


@pytest.mark.parametrize("kind", sorted(SIDECARS))
def test_a_damaged_checksum_record_is_a_checksum_error_naming_the_url(
    kind: str, direct_plugin: S3CheckpointIO, s3_server: S3Endpoint, bucket: str
) -> None:
    # Written without any checksum, so the package's own record (the sidecar) is what a load verifies against.
    plain = s3_server.client(request_checksum_calculation="when_required", response_checksum_validation="when_required")
    data = checkpoint_bytes({"w": torch.arange(10.0)})
    etag = plain.put_object(Bucket=bucket, Key="run/m.ckpt", Body=data)["ETag"]
    stored = plain.head_object(Bucket=bucket, Key="run/m.ckpt", ChecksumMode="ENABLED")
    if any(name.startswith("Checksum") and name != "ChecksumType" for name in stored):
        pytest.skip(f"{s3_server.name} computes a checksum by itself: the record is never consulted")
    plain.put_object(Bucket=bucket, Key="run/m.ckpt" + CHECKSUM_SIDECAR_SUFFIX, Body=SIDECARS[kind](len(data), etag))
    url = f"s3://{bucket}/run/m.ckpt"
    with pytest.raises(ChecksumMismatchError) as raised:
        direct_plugin.load_checkpoint(url)
    assert url in rendered(raised.value)
