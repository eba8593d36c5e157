"""Tests for s3_dirpath_utils: example tables for every function, bucket-name rules in strict and relaxed mode, the
1024-byte key limit, pathlib-collapsed URLs, Hypothesis properties, and the standard-library-only promise."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import sys
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import s3_dirpath_utils as u

ENV = "S3_CHECKPOINT_IO_RELAXED_BUCKET_NAMES"
OPT_OUT = "strict_bucket_names=False"


@pytest.fixture(autouse=True, scope="module")
def _no_relaxed_env() -> Iterator[None]:
    """Start every test in strict mode whatever the developer's shell exports (module scope, so Hypothesis tests
    are not flagged for function-scoped fixtures)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(ENV, raising=False)
        yield


class FsPath:
    """A minimal os.PathLike that is not a pathlib path (returns its text unchanged)."""

    def __init__(self, text: str | bytes) -> None:
        self.text = text

    def __fspath__(self) -> str | bytes:
        return self.text

    def __repr__(self) -> str:
        return f"FsPath({self.text!r})"


# ---- is_s3_url ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("s3://bkt/key", True),
        ("s3://bkt", True),
        ("s3://", True),  # S3-shaped; parse_s3_url rejects the empty bucket
        ("s3://Not_Valid/k", True),  # only the scheme is looked at
        ("s3:/bkt/key", False),  # a str is never repaired
        ("s3:", False),
        ("s3:bkt/key", False),
        ("s3//bkt/key", False),
        ("S3://bkt/key", False),
        (" s3://bkt/key", False),  # no stripping
        ("\ts3://bkt/key", False),
        ("", False),
        ("/local/path/ckpt", False),
        ("relative/ckpt", False),
        ("http://bkt/key", False),
        ("file:///tmp/x", False),
        ("gs://bkt/key", False),
        (None, False),
        (PurePosixPath("s3://bkt/key"), True),
        (Path("s3://bkt/a/b.ckpt"), True),
        (PurePosixPath("s3://bkt"), True),
        (PurePosixPath("s3:/bkt/key"), True),
        (FsPath("s3://bkt//key/"), True),
        (FsPath("s3:/bkt/key"), True),
        (PurePosixPath("s3:"), False),  # what Path("s3://") becomes: no bucket left
        (PurePosixPath("s3"), False),
        (PurePosixPath("/data/s3:/bkt"), False),
        (Path("relative/ckpt"), False),
        (FsPath("/tmp/ckpt"), False),
    ],
)
def test_is_s3_url(path: object, expected: bool) -> None:
    assert u.is_s3_url(path) is expected  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, 1, 1.5, b"s3://bkt/key", bytearray(b"s3://bkt"), ["s3://bkt"], object()])
def test_is_s3_url_rejects_other_types(bad: object) -> None:
    with pytest.raises(TypeError, match=re.escape(type(bad).__name__)):
        u.is_s3_url(bad)  # type: ignore[arg-type]


def test_bytes_pathlike_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="bytes"):
        u.is_s3_url(FsPath(b"s3://bkt/key"))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes"):
        u.parse_s3_url(FsPath(b"s3://bkt/key"))  # type: ignore[arg-type]


# ---- normalize_s3_url ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("s3://bkt/key", "s3://bkt/key"),
        ("s3://bkt//a/b/", "s3://bkt//a/b/"),  # str untouched
        ("s3://", "s3://"),
        ("s3://Any_Bucket/k", "s3://Any_Bucket/k"),  # no bucket check here
        (PurePosixPath("s3://bkt/a/b.ckpt"), "s3://bkt/a/b.ckpt"),
        (Path("s3://bkt/a/b.ckpt"), "s3://bkt/a/b.ckpt"),
        (Path("s3://bkt"), "s3://bkt"),
        (Path("s3://bkt/"), "s3://bkt"),
        (PurePosixPath("s3:/bkt/ü k=1.ckpt"), "s3://bkt/ü k=1.ckpt"),
        (FsPath("s3://bkt//k/"), "s3://bkt//k/"),  # an uncollapsed path object is kept as is
        (FsPath("s3:/bkt/k"), "s3://bkt/k"),
    ],
)
def test_normalize_s3_url(path: object, expected: str) -> None:
    result = u.normalize_s3_url(path)  # type: ignore[arg-type]
    assert result == expected
    assert type(result) is str


@pytest.mark.parametrize(
    "path",
    [
        "",
        "s3:/bkt/key",
        "s3:",
        "s3:bkt",
        "S3://bkt/k",
        " s3://bkt/k",
        "/local/x",
        "http://bkt/k",
        PurePosixPath("s3:"),
        PurePosixPath("local/ckpt"),
        Path("/abs/ckpt"),
    ],
)
def test_normalize_s3_url_rejects_non_s3(path: object) -> None:
    with pytest.raises(ValueError) as info:
        u.normalize_s3_url(path)  # type: ignore[arg-type]
    assert repr(path) in str(info.value)


@pytest.mark.parametrize("bad", [None, 3, b"s3://bkt/k", ("s3://bkt",)])
def test_normalize_s3_url_type_errors(bad: object) -> None:
    with pytest.raises(TypeError, match=re.escape(type(bad).__name__)):
        u.normalize_s3_url(bad)  # type: ignore[arg-type]


def test_collapsed_str_message_explains_pathlib() -> None:
    with pytest.raises(ValueError, match="pathlib") as info:
        u.parse_s3_url("s3:/bkt/key")
    message = str(info.value)
    assert repr("s3:/bkt/key") in message
    assert "str" in message and "Path" in message


# ---- parse_s3_url -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("s3://bkt", ("bkt", "")),
        ("s3://bkt/", ("bkt", "")),
        ("s3://bkt/key", ("bkt", "key")),
        ("s3://bkt/a/b/c.ckpt", ("bkt", "a/b/c.ckpt")),
        ("s3://bkt/dir/", ("bkt", "dir/")),
        ("s3://bkt/a//b/", ("bkt", "a//b/")),
        ("s3://bkt//leading", ("bkt", "/leading")),
        ("s3://bkt//", ("bkt", "/")),
        ("s3://bkt/ü ñ 日本/é.ckpt", ("bkt", "ü ñ 日本/é.ckpt")),
        ("s3://bkt/model--step=10-epoch=2.ckpt", ("bkt", "model--step=10-epoch=2.ckpt")),
        ("s3://bkt/100%25/a%20b+c", ("bkt", "100%25/a%20b+c")),  # no percent-decoding
        ("s3://bkt/a b /c ", ("bkt", "a b /c ")),
        ("s3://bkt/?x=1#frag", ("bkt", "?x=1#frag")),
        ("s3://my.bucket-1/k", ("my.bucket-1", "k")),
        ("s3://my-bucket--usw2-az1--x-s3/k", ("my-bucket--usw2-az1--x-s3", "k")),
        (PurePosixPath("s3://bkt/a/b.ckpt"), ("bkt", "a/b.ckpt")),
        (Path("s3://bkt"), ("bkt", "")),
        (Path("s3://bkt/dir/"), ("bkt", "dir")),  # pathlib already dropped the trailing '/'
        (FsPath("s3://bkt/dir/"), ("bkt", "dir/")),
    ],
)
def test_parse_s3_url(url: object, expected: tuple[str, str]) -> None:
    assert u.parse_s3_url(url) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("", "s3://"),
        ("/local/path", "s3://"),
        ("relative/path", "s3://"),
        ("http://bkt/key", "s3://"),
        ("S3://bkt/key", "exactly"),
        (" s3://bkt/key", "s3://"),
        ("s3:/bkt/key", "pathlib"),
        ("s3:/", "pathlib"),
        ("s3:", "s3://"),
        ("s3:bkt/key", "s3://"),
        ("s3://", "empty"),
        ("s3:///key", "empty"),
        ("s3:////", "empty"),
        ("s3://b/key", "3 to 63"),
        ("s3://Bkt/key", "'B'"),
        ("s3://bkt name/key", "' '"),
        ("s3://bkt\n/key", "'\\n'"),
        ("s3://bkt/\ud800", "UTF-8"),
        ("s3://bkt/" + "k" * 1025, "1025 bytes"),
        (PurePosixPath("s3:"), "s3://"),
        (PurePosixPath("local/ckpt"), "s3://"),
        (PurePosixPath("s3://Bad_Bucket/k"), "'B'"),
    ],
)
def test_parse_s3_url_rejects(url: object, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        u.parse_s3_url(url)  # type: ignore[arg-type]
    message = str(info.value)
    assert repr(url) in message
    assert reason in message


@pytest.mark.parametrize("bad", [None, 0, 12.5, b"s3://bkt/key", ["s3://bkt/key"]])
def test_parse_s3_url_type_errors(bad: object) -> None:
    with pytest.raises(TypeError, match=re.escape(type(bad).__name__)):
        u.parse_s3_url(bad)  # type: ignore[arg-type]


# ---- bucket names -------------------------------------------------------------------------------------------------

STRICT_VALID = [
    "abc",
    "a" * 63,
    "bkt",
    "my-bucket",
    "my.bucket.name",
    "123",
    "1-2",
    "a-.b",
    "a.-b",
    "a--b",
    "1.2.3",  # three numbers: not an IP address
    "1.2.3.4.5",
    "1.2.3.a",
    "xn-bucket",  # only 'xn--' is reserved
    "bucket-xn--x",
    "sthree",
    "amzn-s3-demo",
    "s3alias",
    "bucket-s3alias-x",
    "bucket--ol-s3x",
    "mrap.bucket",
    "bucket-mrap",
    "my-bucket--usw2-az1--x-s3",  # directory bucket
    "a--use1-az4--x-s3",
    "ckpt--usw2-lax1-az1--x-s3",  # directory bucket in a Local Zone
    "my-bucket-s3alias",  # access point alias
    "my-ap-hrzrlukc5m36ft7okagglf3gmwluquse1b-s3alias",
    "my-bucket--ol-s3",  # Object Lambda access point alias
    "my-object-lambda-acc-1a4n8yjrb3kda96f67zwrwiiuse1a--ol-s3",
]

STRICT_INVALID = [
    ("", "empty"),
    ("ab", "3 to 63"),
    ("a", "3 to 63"),
    ("a" * 64, "3 to 63"),
    ("My-bucket", "'M'"),
    ("my_bucket", "'_'"),
    ("my bucket", "' '"),
    ("bücket", "'ü'"),
    ("bkt/x", "'/'"),
    ("bkt:x", "':'"),
    ("-bucket", "begin and end"),
    ("bucket-", "begin and end"),
    (".bucket", "begin and end"),
    ("bucket.", "begin and end"),
    ("my..bucket", "adjacent periods"),
    ("192.168.5.4", "IP address"),
    ("0.0.0.0", "IP address"),
    ("255.255.255.255", "IP address"),
    ("xn--bucket", "'xn--'"),
    ("sthree-bucket", "'sthree-'"),
    ("sthree-configurator", "'sthree-'"),
    ("amzn-s3-demo-bucket", "'amzn-s3-demo-'"),
    ("my-bucket.mrap", "'.mrap'"),
    ("x--x-s3", "BASE--ZONE-ID--x-s3"),  # the directory suffix without a zone id
    ("my-bucket--x-s3", "BASE--ZONE-ID--x-s3"),
    ("my.bucket--usw2-az1--x-s3", "'.'"),
    ("-lead--usw2-az1--x-s3", "begin and end"),
    ("my_ap-s3alias", "'_'"),  # aliases still follow the character rules
]

RELAXED_VALID = [
    "b",
    "ab",
    "My_Bucket",
    "UPPER",
    "x..y",
    "192.168.5.4",
    "xn--abc",
    "bucket.mrap",
    "x--x-s3",
    "-lead",
    "bücket",
    "a" * 255,
    "weird:name@1",
]

RELAXED_INVALID = [
    ("", "empty"),
    ("a" * 256, "255"),
    ("my/bucket", "'/'"),
    ("my bucket", "whitespace"),
    ("tab\tbucket", "whitespace"),
    ("nl\n", "whitespace"),
    ("nul\x00", "control"),
    ("del\x7f", "control"),
    ("nel\x85", "control"),
    ("ideographic\u3000space", "whitespace"),
    ("lone\ud800", "surrogate"),
]


@pytest.mark.parametrize("bucket", STRICT_VALID)
def test_strict_valid_buckets(bucket: str) -> None:
    assert u.validate_bucket_name(bucket) == bucket
    assert u.validate_bucket_name(bucket, strict=True) == bucket
    assert u.parse_s3_url(f"s3://{bucket}/k") == (bucket, "k")


@pytest.mark.parametrize(("bucket", "reason"), STRICT_INVALID)
def test_strict_invalid_buckets(bucket: str, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        u.validate_bucket_name(bucket)
    message = str(info.value)
    assert repr(bucket) in message
    assert reason in message
    assert OPT_OUT in message and ENV in message


@pytest.mark.parametrize(("bucket", "reason"), [(b, r) for b, r in STRICT_INVALID if b and "/" not in b])
def test_strict_invalid_buckets_in_urls(bucket: str, reason: str) -> None:
    url = f"s3://{bucket}/key"
    with pytest.raises(ValueError) as info:
        u.parse_s3_url(url)
    assert repr(url) in str(info.value)
    assert reason in str(info.value)
    assert OPT_OUT in str(info.value)
    with pytest.raises(ValueError, match=re.escape(reason)):
        u.build_s3_url(bucket, "key")


@pytest.mark.parametrize("bucket", RELAXED_VALID)
def test_relaxed_valid_buckets_by_argument(bucket: str) -> None:
    with pytest.raises(ValueError):
        u.validate_bucket_name(bucket)  # all of these break a strict rule
    assert u.validate_bucket_name(bucket, strict=False) == bucket
    assert u.parse_s3_url(f"s3://{bucket}/k", strict_bucket_names=False) == (bucket, "k")
    assert u.build_s3_url(bucket, "k", strict_bucket_names=False) == f"s3://{bucket}/k"


@pytest.mark.parametrize("bucket", RELAXED_VALID)
def test_relaxed_valid_buckets_by_environment(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "1")
    assert u.validate_bucket_name(bucket) == bucket
    url = f"s3://{bucket}/dir/k"
    assert u.parse_s3_url(url) == (bucket, "dir/k")
    assert u.build_s3_url(bucket, "dir/k") == url
    assert u.join_s3_url(f"s3://{bucket}", "dir", "k") == url
    assert u.s3_url_parent(url) == f"s3://{bucket}/dir"
    assert u.s3_url_name(url) == "k"
    assert u.s3_dir_prefix(url) == (bucket, "dir/k/")


@pytest.mark.parametrize(("bucket", "reason"), RELAXED_INVALID)
def test_relaxed_invalid_buckets(bucket: str, reason: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for attempt in ("argument", "environment"):
        if attempt == "environment":
            monkeypatch.setenv(ENV, "1")
        with pytest.raises(ValueError) as info:
            u.validate_bucket_name(bucket, strict=False if attempt == "argument" else None)
        message = str(info.value)
        assert repr(bucket) in message
        assert reason in message
        assert OPT_OUT not in message  # already relaxed: the hint would be wrong


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes", " on "])
def test_environment_values_that_relax(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, value)
    assert u.parse_s3_url("s3://My_Bucket/k") == ("My_Bucket", "k")


@pytest.mark.parametrize("value", ["", "0", "false", "No", "off"])
def test_environment_values_that_keep_strict(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match="'M'"):
        u.parse_s3_url("s3://My_Bucket/k")


def test_unknown_environment_value_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "maybe")
    with pytest.raises(ValueError, match=ENV) as info:
        u.parse_s3_url("s3://bkt/k")
    assert "'maybe'" in str(info.value)
    assert u.parse_s3_url("s3://bkt/k", strict_bucket_names=True) == ("bkt", "k")  # argument: env not consulted


def test_environment_is_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError):
        u.parse_s3_url("s3://UP/k")
    monkeypatch.setenv(ENV, "1")
    assert u.parse_s3_url("s3://UP/k") == ("UP", "k")
    monkeypatch.delenv(ENV)
    with pytest.raises(ValueError):
        u.parse_s3_url("s3://UP/k")


def test_argument_wins_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(ValueError, match="'U'"):
        u.validate_bucket_name("UPPER", strict=True)
    with pytest.raises(ValueError, match="'U'"):
        u.parse_s3_url("s3://UPPER/k", strict_bucket_names=True)
    with pytest.raises(ValueError, match="'U'"):
        u.build_s3_url("UPPER", "k", strict_bucket_names=True)
    with pytest.raises(ValueError, match="'U'"):
        u.join_s3_url("s3://UPPER", "k", strict_bucket_names=True)
    monkeypatch.setenv(ENV, "0")
    assert u.parse_s3_url("s3://UPPER/k", strict_bucket_names=False) == ("UPPER", "k")
    assert u.s3_url_parent("s3://UPPER/a/k", strict_bucket_names=False) == "s3://UPPER/a"
    assert u.s3_url_name("s3://UPPER/a/k", strict_bucket_names=False) == "k"
    assert u.s3_dir_prefix("s3://UPPER/a", strict_bucket_names=False) == ("UPPER", "a/")


@pytest.mark.parametrize("bad", [None, 3, b"bkt"])
def test_validate_bucket_name_type_errors(bad: object) -> None:
    with pytest.raises(TypeError, match=re.escape(type(bad).__name__)):
        u.validate_bucket_name(bad)  # type: ignore[arg-type]


# ---- keys: exact characters and the 1024-byte limit ---------------------------------------------------------------

SPECIAL_KEYS = [
    "ü ñ 日本語/é.ckpt",
    "with space/ and  two  spaces ",
    "a=b/step=10-epoch=2.ckpt",
    "100%/x%20y%2Fz",
    "a+b/c+d",
    "trailing/",
    "a//b///c",
    "?query=1#frag",
    "~!@$&*()[]{};:',<>|\\^`\"",
    "emoji 😀/x",
    "tab\tnewline\n",
    ".",
    "../x",
]


@pytest.mark.parametrize("key", SPECIAL_KEYS)
def test_keys_are_preserved(key: str) -> None:
    url = u.build_s3_url("bkt", key)
    assert url == "s3://bkt/" + key
    assert u.parse_s3_url(url) == ("bkt", key)


@pytest.mark.parametrize(
    ("key", "ok"),
    [
        ("k" * 1024, True),
        ("k" * 1025, False),
        ("é" * 512, True),  # 2 bytes each: 1024 bytes
        ("é" * 512 + "k", False),  # 513 characters, 1025 bytes
        ("é" * 1024, False),  # 1024 characters but 2048 bytes
        ("日" * 341 + "k", True),  # 3 * 341 + 1 = 1024 bytes
        ("日" * 341 + "kk", False),
        ("😀" * 256, True),  # 4 bytes each
        ("😀" * 256 + "k", False),
    ],
)
def test_key_length_limit_is_in_utf8_bytes(key: str, ok: bool) -> None:
    url = "s3://bkt/" + key
    if ok:
        assert u.parse_s3_url(url) == ("bkt", key)
        assert u.build_s3_url("bkt", key) == url
        return
    size = len(key.encode("utf-8"))
    with pytest.raises(ValueError, match=f"{size} bytes"):
        u.parse_s3_url(url)
    with pytest.raises(ValueError, match=f"{size} bytes"):
        u.build_s3_url("bkt", key)
    with pytest.raises(ValueError, match=f"{size} bytes"):
        u.join_s3_url("s3://bkt", key)


@pytest.mark.parametrize("key", ["\ud800", "a\udfffb", "ok/\udc80.ckpt"])
def test_keys_that_are_not_utf8_are_rejected(key: str) -> None:
    with pytest.raises(ValueError, match="UTF-8"):
        u.parse_s3_url("s3://bkt/" + key)
    with pytest.raises(ValueError, match="UTF-8"):
        u.build_s3_url("bkt", key)


# ---- build_s3_url -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bucket", "key", "expected"),
    [
        ("bkt", "", "s3://bkt"),
        ("bkt", "a", "s3://bkt/a"),
        ("bkt", "a/b.ckpt", "s3://bkt/a/b.ckpt"),
        ("bkt", "a/", "s3://bkt/a/"),
        ("bkt", "a//b", "s3://bkt/a//b"),
        ("bkt", "/a/b", "s3://bkt/a/b"),  # no '//' after the bucket
        ("bkt", "///a", "s3://bkt/a"),
        ("bkt", "/", "s3://bkt"),
        ("my.bucket-1", "x y=1", "s3://my.bucket-1/x y=1"),
    ],
)
def test_build_s3_url(bucket: str, key: str, expected: str) -> None:
    assert u.build_s3_url(bucket, key) == expected


def test_build_s3_url_default_key() -> None:
    assert u.build_s3_url("bkt") == "s3://bkt"


@pytest.mark.parametrize(("bucket", "key"), [(None, "k"), (3, "k"), (b"bkt", "k"), ("bkt", None), ("bkt", b"k")])
def test_build_s3_url_type_errors(bucket: object, key: object) -> None:
    with pytest.raises(TypeError):
        u.build_s3_url(bucket, key)  # type: ignore[arg-type]


# ---- join_s3_url --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "parts", "expected"),
    [
        ("s3://bkt", ("a", "c.ckpt"), "s3://bkt/a/c.ckpt"),
        ("s3://bkt/dir/", ("x",), "s3://bkt/dir/x"),
        ("s3://bkt/dir", ("/x",), "s3://bkt/dir/x"),
        ("s3://bkt/dir//", ("//x",), "s3://bkt/dir/x"),
        ("s3://bkt", ("a/", "/b/"), "s3://bkt/a/b/"),  # trailing '/' of the last part is kept
        ("s3://bkt/a", ("x//y",), "s3://bkt/a/x//y"),  # inner '//' kept
        ("s3://bkt/a", ("",), "s3://bkt/a"),
        ("s3://bkt/a", ("", "b"), "s3://bkt/a/b"),
        ("s3://bkt/a", ("/",), "s3://bkt/a/"),
        ("s3://bkt", (), "s3://bkt"),
        ("s3://bkt/", (), "s3://bkt/"),
        ("s3://bkt/", ("x",), "s3://bkt/x"),
        ("s3://bkt/ckpt", ("step=1 é.ckpt",), "s3://bkt/ckpt/step=1 é.ckpt"),
        ("s3://bkt/a", ("s3:/x",), "s3://bkt/a/s3:/x"),  # not an absolute s3:// URL: an ordinary key segment
        (PurePosixPath("s3://bkt/ckpts"), ("last.ckpt",), "s3://bkt/ckpts/last.ckpt"),
        (Path("s3://bkt"), ("a", "b"), "s3://bkt/a/b"),
    ],
)
def test_join_s3_url(base: object, parts: tuple[str, ...], expected: str) -> None:
    assert u.join_s3_url(base, *parts) == expected  # type: ignore[arg-type]


def test_join_s3_url_rejects_absolute_parts() -> None:
    with pytest.raises(ValueError, match=re.escape(repr("s3://other/x"))):
        u.join_s3_url("s3://bkt/a", "s3://other/x")
    with pytest.raises(ValueError, match="absolute"):
        u.join_s3_url("s3://bkt/a", "b", "s3://bkt/c")


@pytest.mark.parametrize("part", [None, 1, b"x", Path("x")])
def test_join_s3_url_parts_must_be_str(part: object) -> None:
    with pytest.raises(TypeError, match=re.escape(type(part).__name__)):
        u.join_s3_url("s3://bkt", part)  # type: ignore[arg-type]


@pytest.mark.parametrize("base", ["s3:/bkt/a", "/local/dir", "http://bkt/a", "s3://", "s3://Bad_Bucket"])
def test_join_s3_url_rejects_bad_bases(base: str) -> None:
    with pytest.raises(ValueError) as info:
        u.join_s3_url(base, "x")
    assert repr(base) in str(info.value)


def test_join_s3_url_rejects_too_long_results() -> None:
    assert u.join_s3_url("s3://bkt/" + "a" * 1000, "b" * 23) == "s3://bkt/" + "a" * 1000 + "/" + "b" * 23
    with pytest.raises(ValueError, match="1025 bytes"):
        u.join_s3_url("s3://bkt/" + "a" * 1000, "b" * 24)


# ---- parent, name, directory prefix -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "parent", "name"),
    [
        ("s3://bkt/a/c.ckpt", "s3://bkt/a", "c.ckpt"),
        ("s3://bkt/a/", "s3://bkt", "a"),
        ("s3://bkt/a//", "s3://bkt", "a"),
        ("s3://bkt/x", "s3://bkt", "x"),
        ("s3://bkt", "s3://bkt", ""),
        ("s3://bkt/", "s3://bkt", ""),
        ("s3://bkt/a/b/c/", "s3://bkt/a/b", "c"),
        ("s3://bkt/a//c", "s3://bkt/a", "c"),
        ("s3://bkt//x/y", "s3://bkt//x", "y"),
        ("s3://bkt/ü k/step=1.ckpt", "s3://bkt/ü k", "step=1.ckpt"),
        (PurePosixPath("s3://bkt/a/b.ckpt"), "s3://bkt/a", "b.ckpt"),
        (Path("s3://bkt/a"), "s3://bkt", "a"),
    ],
)
def test_parent_and_name(url: object, parent: str, name: str) -> None:
    assert u.s3_url_parent(url) == parent  # type: ignore[arg-type]
    assert u.s3_url_name(url) == name  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("s3://bkt/ckpt", ("bkt", "ckpt/")),
        ("s3://bkt/ckpt/", ("bkt", "ckpt/")),
        ("s3://bkt/ckpt//", ("bkt", "ckpt/")),
        ("s3://bkt/a/b", ("bkt", "a/b/")),
        ("s3://bkt/a//b", ("bkt", "a//b/")),
        ("s3://bkt", ("bkt", "")),
        ("s3://bkt/", ("bkt", "")),
        ("s3://bkt//", ("bkt", "/")),  # a key of only slashes never widens to the whole bucket
        (Path("s3://bkt/ckpt"), ("bkt", "ckpt/")),
    ],
)
def test_s3_dir_prefix(url: object, expected: tuple[str, str]) -> None:
    assert u.s3_dir_prefix(url) == expected  # type: ignore[arg-type]


def test_s3_dir_prefix_does_not_match_sibling_directories() -> None:
    _, prefix = u.s3_dir_prefix("s3://bkt/ckpt")
    assert "ckpt/last.ckpt".startswith(prefix)
    assert not "ckpt_old/last.ckpt".startswith(prefix)
    assert not "ckpt".startswith(prefix)


@pytest.mark.parametrize("function", [u.s3_url_parent, u.s3_url_name, u.s3_dir_prefix])
@pytest.mark.parametrize("url", ["s3:/bkt/a", "", "/local/a", "s3://", "s3://Bad_Bucket/a", "s3://bkt/\ud800"])
def test_directory_helpers_reject_invalid_urls(function: object, url: str) -> None:
    with pytest.raises(ValueError) as info:
        function(url)  # type: ignore[operator]
    assert repr(url) in str(info.value)


@pytest.mark.parametrize("function", [u.s3_url_parent, u.s3_url_name, u.s3_dir_prefix, u.join_s3_url])
@pytest.mark.parametrize("bad", [None, 7, b"s3://bkt/a"])
def test_directory_helpers_type_errors(function: object, bad: object) -> None:
    with pytest.raises(TypeError):
        function(bad)  # type: ignore[operator]


# ---- Hypothesis ---------------------------------------------------------------------------------------------------

_EDGE = "abcdefghijklmnopqrstuvwxyz0123456789"
_IPV4 = re.compile(r"[0-9]{1,3}(\.[0-9]{1,3}){3}")


def _follows_the_remaining_rules(name: str) -> bool:
    return (
        ".." not in name
        and not _IPV4.fullmatch(name)
        and not name.startswith(("xn--", "sthree-", "amzn-s3-demo-"))
        and not name.endswith((".mrap", "--x-s3"))
    )


valid_buckets = st.one_of(
    st.builds(
        lambda first, middle, last: first + middle + last,
        st.sampled_from(_EDGE),
        st.text(alphabet=_EDGE + ".-", min_size=1, max_size=61),
        st.sampled_from(_EDGE),
    ).filter(_follows_the_remaining_rules),
    st.sampled_from(STRICT_VALID),
)

_partitions = st.sampled_from(["aws", "aws-cn", "aws-us-gov"])
_regions = st.sampled_from(["us-west-2", "us-east-1", "eu-central-1", "cn-north-1", "us-gov-west-1", "ap-southeast-2"])
_accounts = st.text(alphabet="0123456789", min_size=12, max_size=12)
_access_point_names = st.builds(
    lambda first, middle, last: first + middle + last,
    st.sampled_from(_EDGE),
    st.text(alphabet=_EDGE + "-", min_size=1, max_size=48),
    st.sampled_from(_EDGE),
)
_outpost_ids = st.text(alphabet="0123456789abcdef", min_size=17, max_size=17).map(lambda h: "op-" + h)
access_point_arns = st.one_of(
    st.builds(
        lambda p, r, a, n: f"arn:{p}:s3:{r}:{a}:accesspoint/{n}", _partitions, _regions, _accounts, _access_point_names
    ),
    st.builds(
        lambda p, r, a, o, n: f"arn:{p}:s3-outposts:{r}:{a}:outpost/{o}/accesspoint/{n}",
        _partitions,
        _regions,
        _accounts,
        _outpost_ids,
        _access_point_names,
    ),
)
directory_buckets = st.builds(
    lambda base, zone: f"{base}--{zone}--x-s3",
    st.text(alphabet="abcdefghij0123456789", min_size=3, max_size=20),
    st.sampled_from(["usw2-az1", "use1-az4", "apne1-az4", "usw2-lax1-az1", "euc1-az3"]),
)
aliases = st.builds(
    lambda name, suffix: name + suffix,
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=3, max_size=40),
    st.sampled_from(["-s3alias", "--ol-s3"]),
)
every_bucket_kind = st.one_of(valid_buckets, access_point_arns, directory_buckets, aliases)

valid_keys = (
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)))
    .filter(lambda key: not key.startswith("/"))
    .filter(lambda key: len(key.encode("utf-8")) <= 1024)
)

segments = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40).filter(
    lambda s: "/" not in s
)

anything = st.one_of(
    st.text(),
    st.text().map(lambda s: "s3://" + s),
    st.text().map(lambda s: "s3:/" + s),
    st.builds(lambda b, k: f"s3://{b}/{k}", valid_buckets, st.text()),
    st.none(),
    st.integers(),
    st.floats(),
    st.binary(),
    st.lists(st.text(), max_size=2),
    st.builds(PurePosixPath, st.text()),
    st.builds(lambda s: PurePosixPath("s3://" + s), st.text()),
    st.builds(lambda s: FsPath("s3://" + s), st.text()),
)

strict_choices = st.sampled_from([None, True, False])


@given(valid_buckets)
def test_generated_buckets_are_valid(bucket: str) -> None:
    assert u.validate_bucket_name(bucket) == bucket


@given(every_bucket_kind, valid_keys)
def test_build_parse_round_trip(bucket: str, key: str) -> None:
    url = u.build_s3_url(bucket, key)
    assert url == (f"s3://{bucket}/{key}" if key else f"s3://{bucket}")
    assert u.parse_s3_url(url) == (bucket, key)
    assert u.is_s3_url(url)
    assert u.normalize_s3_url(url) == url


@given(anything)
def test_is_s3_url_only_raises_type_error(value: object) -> None:
    try:
        result = u.is_s3_url(value)  # type: ignore[arg-type]
    except TypeError:
        assert value is not None and not isinstance(value, (str, os.PathLike))
        return
    assert isinstance(result, bool)


@given(anything)
def test_normalize_agrees_with_is_s3_url(value: object) -> None:
    try:
        recognised = u.is_s3_url(value)  # type: ignore[arg-type]
    except TypeError:
        with pytest.raises(TypeError):
            u.normalize_s3_url(value)  # type: ignore[arg-type]
        return
    if value is None:
        with pytest.raises(TypeError):
            u.normalize_s3_url(value)  # type: ignore[arg-type]
    elif recognised:
        assert u.normalize_s3_url(value).startswith("s3://")  # type: ignore[arg-type]
    else:
        with pytest.raises(ValueError):
            u.normalize_s3_url(value)  # type: ignore[arg-type]


@given(anything, strict_choices)
def test_parse_s3_url_only_raises_value_or_type_error(value: object, strict: bool | None) -> None:
    try:
        bucket, key = u.parse_s3_url(value, strict_bucket_names=strict)  # type: ignore[arg-type]
    except (ValueError, TypeError):
        return
    assert u.is_s3_url(value)  # type: ignore[arg-type]
    assert bucket and "/" not in bucket
    assert len(key.encode("utf-8")) <= 1024


@given(anything, anything, strict_choices)
def test_build_s3_url_only_raises_value_or_type_error(bucket: object, key: object, strict: bool | None) -> None:
    try:
        url = u.build_s3_url(bucket, key, strict_bucket_names=strict)  # type: ignore[arg-type]
    except (ValueError, TypeError):
        return
    assert u.parse_s3_url(url, strict_bucket_names=strict) == (bucket, key.lstrip("/"))  # type: ignore[union-attr]


@given(anything, st.lists(st.one_of(st.text(), anything), max_size=3), strict_choices)
def test_join_s3_url_only_raises_value_or_type_error(base: object, parts: list[object], strict: bool | None) -> None:
    try:
        url = u.join_s3_url(base, *parts, strict_bucket_names=strict)  # type: ignore[arg-type]
    except (ValueError, TypeError):
        return
    u.parse_s3_url(url, strict_bucket_names=strict)


@pytest.mark.parametrize("function", [u.s3_url_parent, u.s3_url_name, u.s3_dir_prefix])
@given(value=anything, strict=strict_choices)
def test_directory_helpers_only_raise_value_or_type_error(function: object, value: object, strict: bool | None) -> None:
    try:
        function(value, strict_bucket_names=strict)  # type: ignore[operator]
    except (ValueError, TypeError):
        return
    u.parse_s3_url(value, strict_bucket_names=strict)  # type: ignore[arg-type]  # accepted input is a valid URL


@given(valid_buckets, valid_keys, segments)
def test_join_then_parent_and_name(bucket: str, key: str, segment: str) -> None:
    base = u.build_s3_url(bucket, key)
    # room for "/" + segment + a trailing "/"
    assume(len(key.rstrip("/").encode("utf-8")) + len(segment.encode("utf-8")) + 2 <= 1024)
    joined = u.join_s3_url(base, segment)
    assert joined == base.rstrip("/") + "/" + segment
    assert u.s3_url_name(joined) == segment
    assert u.s3_url_parent(joined) == base.rstrip("/")
    assert u.s3_dir_prefix(joined) == (bucket, u.parse_s3_url(joined)[1] + "/")
    assert u.s3_url_name(joined + "/") == segment
    assert u.s3_url_parent(joined + "/") == base.rstrip("/")


@settings(deadline=None)
@given(every_bucket_kind, st.lists(segments, min_size=1, max_size=5))
def test_parent_of_name_rebuilds_the_url(bucket: str, parts: list[str]) -> None:
    url = u.join_s3_url(f"s3://{bucket}", *parts)
    assert u.join_s3_url(u.s3_url_parent(url), u.s3_url_name(url)) == url
    assert u.parse_s3_url(url) == (bucket, "/".join(parts))


@given(valid_buckets, st.lists(segments, min_size=1, max_size=5))
def test_collapsed_pathlib_urls_are_repaired(bucket: str, parts: list[str]) -> None:
    key = "/".join(parts)
    path = PurePosixPath(f"s3://{bucket}/{key}")
    assume(path.as_posix() == f"s3:/{bucket}/{key}")  # pathlib also drops "." segments: those are lost
    assert u.is_s3_url(path)
    assert u.normalize_s3_url(path) == f"s3://{bucket}/{key}"
    assert u.parse_s3_url(path) == (bucket, key)
    assert not u.is_s3_url(str(path))


# ---- module hygiene -----------------------------------------------------------------------------------------------


def test_module_imports_only_the_standard_library() -> None:
    source = Path(u.__file__).read_text(encoding="utf-8")
    tree = ast.parse(source)
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "relative imports break the copy-unedited promise"
            assert node.module is not None
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call):
            callee = node.func
            name = callee.id if isinstance(callee, ast.Name) else getattr(callee, "attr", "")
            assert name not in ("__import__", "import_module"), "no dynamic imports, not even lazily"
    assert imported, "the walk found no imports at all: the test is broken"
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)


def test_public_api() -> None:
    expected = {
        "S3_PATH_PREFIX",
        "is_s3_url",
        "normalize_s3_url",
        "parse_s3_url",
        "validate_bucket_name",
        "build_s3_url",
        "join_s3_url",
        "s3_url_parent",
        "s3_url_name",
        "s3_dir_prefix",
        "bucket_kind",
        "BUCKET_KINDS",
    }
    assert expected <= set(u.__all__)
    assert u.S3_PATH_PREFIX == "s3://"
    for name in u.__all__:
        value = getattr(u, name)
        if callable(value):
            assert value.__doc__ and value.__doc__.strip(), f"{name} has no docstring"
    assert u.__doc__ and "(None, None)" in u.__doc__  # the NeMo differences are documented


def test_pathlib_collapse_premise() -> None:
    """The repair is only needed because pathlib collapses '//'; if that ever changes, revisit the module."""
    assert str(pathlib.PurePosixPath("s3://bkt/k")) == "s3:/bkt/k"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("s3://bkt/a/b.ckpt", "s3://bkt/a/b.ckpt"),
        (pathlib.PurePosixPath("s3://bkt/a/b.ckpt"), "s3://bkt/a/b.ckpt"),
        (pathlib.PurePosixPath("/tmp/x.ckpt"), "/tmp/x.ckpt"),
        ("relative/x.ckpt", "relative/x.ckpt"),
    ],
)
def test_as_path_or_s3_url_keeps_s3_urls_and_local_paths_apart(given, expected: str) -> None:
    assert u.as_path_or_s3_url(given) == expected


@pytest.mark.parametrize("given", ["s3:/bkt/k", "S3://bkt/k", "http://host/k", "gs://bkt/k", "s3:bkt"])
def test_as_path_or_s3_url_refuses_urls_that_are_not_s3(given: str) -> None:
    with pytest.raises(ValueError, match="neither"):
        u.as_path_or_s3_url(given)


# ---- bucket kinds: directory buckets, access point aliases and ARNs ----------------------------------------------

ARN = "arn:aws:s3:us-west-2:123456789012:accesspoint/my-ap"
OUTPOSTS_ARN = "arn:aws:s3-outposts:us-west-2:123456789012:outpost/op-01ac5d28a6a232904/accesspoint/my-ap"


@pytest.mark.parametrize(
    ("bucket", "kind"),
    [
        ("bkt", "general_purpose"),
        ("my.bucket-1", "general_purpose"),
        ("a--b", "general_purpose"),
        ("my-bucket--usw2-az1--x-s3", "directory"),
        ("ckpt--usw2-lax1-az1--x-s3", "directory"),
        ("my-ap-hrzrlukc5m36ft7okagglf3gmwluquse1b-s3alias", "access_point_alias"),
        ("my-object-lambda-acc-1a4n8yjrb3kda96f67zwrwiiuse1a--ol-s3", "object_lambda_alias"),
        (ARN, "access_point_arn"),
        ("arn:aws-cn:s3:cn-north-1:123456789012:accesspoint/ap-1", "access_point_arn"),
        ("arn:aws-us-gov:s3:us-gov-west-1:123456789012:accesspoint/ap-1", "access_point_arn"),
        (OUTPOSTS_ARN, "outposts_access_point_arn"),
        (
            "arn:aws-us-gov:s3-outposts:us-gov-east-1:123456789012:outpost/op-0123456789abcdef0/accesspoint/x1y",
            "outposts_access_point_arn",
        ),
    ],
)
def test_bucket_kind(bucket: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert kind in u.BUCKET_KINDS
    assert u.bucket_kind(bucket) == kind
    assert u.bucket_kind(bucket, strict=False) == kind
    monkeypatch.setenv(ENV, "1")
    assert u.bucket_kind(bucket) == kind  # relaxed mode accepts every kind too


def test_bucket_kind_of_relaxed_names() -> None:
    assert u.bucket_kind("My_Bucket", strict=False) == "general_purpose"
    with pytest.raises(ValueError, match="'M'"):
        u.bucket_kind("My_Bucket")


@pytest.mark.parametrize("bad", ["", "ab", "x--x-s3", "arn:aws:s3:us-west-2:1:accesspoint/ap", "bkt/x"])
def test_bucket_kind_rejects_invalid_names(bad: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        u.bucket_kind(bad)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (f"s3://{ARN}", (ARN, "")),
        (f"s3://{ARN}/", (ARN, "")),
        (f"s3://{ARN}/key", (ARN, "key")),
        (f"s3://{ARN}/a/b/c.ckpt", (ARN, "a/b/c.ckpt")),
        (f"s3://{ARN}/dir/", (ARN, "dir/")),
        (f"s3://{ARN}//x", (ARN, "/x")),
        (f"s3://{OUTPOSTS_ARN}/ckpt/last.ckpt", (OUTPOSTS_ARN, "ckpt/last.ckpt")),
        (
            "s3://my-ap-hrzrlukc5m36ft7okagglf3gmwluquse1b-s3alias/ckpt",
            ("my-ap-hrzrlukc5m36ft7okagglf3gmwluquse1b-s3alias", "ckpt"),
        ),
        ("s3://my-bucket--ol-s3/k", ("my-bucket--ol-s3", "k")),
        ("s3://my-ckpt--usw2-az1--x-s3/run/", ("my-ckpt--usw2-az1--x-s3", "run/")),
        (PurePosixPath(f"s3://{ARN}/a/b.ckpt"), (ARN, "a/b.ckpt")),  # pathlib collapse repaired for ARNs too
    ],
)
def test_parse_bucket_kinds(url: object, expected: tuple[str, str]) -> None:
    assert u.parse_s3_url(url) == expected  # type: ignore[arg-type]
    assert u.parse_s3_url(url, strict_bucket_names=False) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "url",
    [
        "s3://arn:aws:s3:us-west-2:12345678901:accesspoint/my-ap/k",  # 11-digit account
        "s3://arn:aws:s3:us-west-2:123456789012:accesspoint/My_AP/k",
        "s3://arn:aws:s3:us-west-2:123456789012:accesspoint/ap/k",  # name under 3 characters
        "s3://arn:aws:s3:us-west-2:123456789012:accesspoint/my-ap-/k",  # trailing '-'
        "s3://arn:aws:s3:us-west-2:123456789012:accesspoint/" + "a" * 51 + "/k",
        "s3://arn:aws-xx:s3:us-west-2:123456789012:accesspoint/my-ap/k",  # unknown partition
        "s3://arn:aws:s3:uswest:123456789012:accesspoint/my-ap/k",
        "s3://arn:aws:s3:us-west-2:123456789012:bucket/my-ap/k",
        "s3://arn:aws:s3:us-west-2:123456789012:accesspoint/my-apx:y/k",
        "s3://arn:aws:s3-outposts:us-west-2:123456789012:outpost/op-123/accesspoint/my-ap/k",
        "s3://arn:aws:s3-outposts:us-west-2:123456789012:accesspoint/my-ap/k",
        "s3://arn:aws:s3:::my-bucket/k",  # a bucket ARN: S3 takes the bucket name, not its ARN
        "s3://arn:aws:s3::123456789012:accesspoint/mfzwi23gnjvgw.mrap/k",  # multi-Region access points: not supported
    ],
)
def test_malformed_access_point_arns_are_rejected(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for relaxed in (False, True):
        if relaxed:
            monkeypatch.setenv(ENV, "1")
        with pytest.raises(ValueError) as info:
            u.parse_s3_url(url)
        message = str(info.value)
        assert repr(url) in message
        assert "accesspoint/NAME" in message  # says what an ARN must look like
        assert OPT_OUT not in message  # relaxing names does not help an ARN


def test_access_point_arn_round_trips_and_helpers() -> None:
    url = u.build_s3_url(ARN, "ckpt/last.ckpt")
    assert url == f"s3://{ARN}/ckpt/last.ckpt"
    assert u.parse_s3_url(url) == (ARN, "ckpt/last.ckpt")
    assert u.build_s3_url(ARN) == f"s3://{ARN}"
    assert u.build_s3_url(ARN, "/x") == f"s3://{ARN}/x"
    assert u.join_s3_url(f"s3://{ARN}", "ckpt", "last.ckpt") == url
    assert u.s3_url_parent(url) == f"s3://{ARN}/ckpt"
    assert u.s3_url_parent(f"s3://{ARN}/ckpt") == f"s3://{ARN}"
    assert u.s3_url_parent(f"s3://{ARN}") == f"s3://{ARN}"
    assert u.s3_url_name(url) == "last.ckpt"
    assert u.s3_url_name(f"s3://{ARN}") == ""
    assert u.s3_dir_prefix(f"s3://{ARN}/ckpt") == (ARN, "ckpt/")
    assert u.s3_dir_prefix(f"s3://{ARN}") == (ARN, "")
    assert u.validate_bucket_name(OUTPOSTS_ARN) == OUTPOSTS_ARN
    assert u.as_path_or_s3_url(url) == url


def test_arn_is_not_a_bucket_name_with_a_slash() -> None:
    """Only a complete ARN may contain '/': its prefix alone, or an ARN with more segments, is refused."""
    with pytest.raises(ValueError, match="accesspoint/NAME"):
        u.validate_bucket_name("arn:aws:s3:us-west-2:123456789012:accesspoint")
    with pytest.raises(ValueError, match="accesspoint/NAME"):
        u.validate_bucket_name(ARN + "/extra")
    with pytest.raises(ValueError, match="accesspoint/NAME"):
        u.build_s3_url(ARN + "x:y", "k")


@given(access_point_arns, valid_keys)
def test_access_point_arns_classify_and_round_trip(arn: str, key: str) -> None:
    assert u.bucket_kind(arn) in ("access_point_arn", "outposts_access_point_arn")
    assert u.parse_s3_url(u.build_s3_url(arn, key)) == (arn, key)


@given(directory_buckets)
def test_generated_directory_buckets(bucket: str) -> None:
    assume(len(bucket) <= 63)
    assert u.bucket_kind(bucket) == "directory"
