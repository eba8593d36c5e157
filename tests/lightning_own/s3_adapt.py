"""What turns Lightning's own checkpoint tests (vendored beside this module) into tests of this package on ``s3://``.

Each vendored test module imports its ``Trainer`` and ``ModelCheckpoint`` from here (an edit marked ``# s3:``), and
the directory's conftest makes ``tmp_path`` an `S3Path` on the suite's S3 server. What a test then runs:

- `Trainer`: Lightning's Trainer, with an `S3CheckpointIO` (sync or async: the conftest's ``s3_mode``) added as its
  checkpoint plugin unless the test gives its own plugin. Nothing else changes.
- `ModelCheckpoint`: the package's `S3ModelCheckpoint` (the callback a Lightning user puts on an ``s3://`` dirpath);
  the conftest also makes it the callback Lightning adds by itself (``enable_checkpointing=True``), as
  ``configure_s3_checkpointing`` does.
- `S3Path`: the test's ``tmp_path`` as an ``s3://bucket/prefix`` str that also answers pathlib's questions
  (``/``, ``name``, ``parent``, ``iterdir``, ``glob``, ``exists``, ...) from S3.
- `listdir`, `isfile`, `isdir`, `torch_load`, `read_bytes`: ``os.listdir``, ``os.path.isfile``, ``os.path.isdir`` and
  ``torch.load`` for an ``s3://`` URL, asked of S3 with a plain boto3 client (not through the package under test).
  A listing is what ``aws s3 ls`` shows of the prefix without the package's own records (checksum records beside
  each checkpoint, the directory's owner record), which a user never names: the files Lightning's tests count.
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import os
from collections.abc import Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO

import connector
import s3_utils
from s3_checkpoint_io import S3CheckpointIO, wait_for_pending_save
from s3_dirpath_utils import parse_s3_url

MODES = ("sync", "async")

SYMLINK = "save_last='link' and _link_checkpoint make local symlinks: no S3 meaning (Lightning refuses them for URLs)"

ModelCheckpoint = connector.S3ModelCheckpoint


class _State:
    """The current test's S3 client, mode and the plugins made for it (set by the conftest's fixtures)."""

    def __init__(self) -> None:
        self.client: Any = None
        self.mode = "sync"
        self.plugins: list[S3CheckpointIO] = []


state = _State()


# ---- S3 as the tests ask a local directory -------------------------------------------------------------------------


def _split(url: str) -> tuple[str, str]:
    bucket, key = parse_s3_url(os.fspath(url))
    return bucket, key.rstrip("/")


def _is_record(name: str) -> bool:
    """The package's own records (never a file a user names): checksum records and a directory's owner record."""
    return name.endswith(s3_utils.CHECKSUM_SIDECAR_SUFFIX) or name == s3_utils.OWNER_RECORD_NAME


def listdir(url: str | os.PathLike[str]) -> list[str]:
    """``os.listdir`` of an S3 "directory": the names of the objects and common prefixes directly under ``url/``,
    sorted (none for an empty prefix: S3 has no empty directories)."""
    bucket, key = _split(os.fspath(url))
    prefix = f"{key}/" if key else ""
    names: list[str] = []
    for page in state.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
        names += [item["Key"][len(prefix) :] for item in page.get("Contents", [])]
        names += [item["Prefix"][len(prefix) :].rstrip("/") for item in page.get("CommonPrefixes", [])]
    return sorted(name for name in names if not _is_record(name))


def isfile(url: str | os.PathLike[str]) -> bool:
    """``os.path.isfile`` for an ``s3://`` URL: an object exists under exactly that key."""
    bucket, key = _split(os.fspath(url))
    try:
        state.client.head_object(Bucket=bucket, Key=key)
    except state.client.exceptions.ClientError as exc:
        if exc.response["Error"]["Code"] in ("404", "NoSuchKey"):
            return False
        raise
    return True


def isdir(url: str | os.PathLike[str]) -> bool:
    """``os.path.isdir`` for an ``s3://`` URL: some object lies under ``url/``."""
    return bool(listdir(url))


def read_bytes(url: str | os.PathLike[str]) -> bytes:
    """The object at an ``s3://`` URL, read as a load in this process reads it: after this process's pending async
    save of that URL settled (docs/lightning.md, "What async saves promise after fit")."""
    wait_for_pending_save(url)
    bucket, key = _split(os.fspath(url))
    return state.client.get_object(Bucket=bucket, Key=key)["Body"].read()


def http_url(url: str | os.PathLike[str]) -> str:
    """An http URL that GETs the object at an ``s3://`` URL (presigned, an hour), handed out as docs/lightning.md says
    a URL is handed to another reader: once this process's pending save of it settled."""
    wait_for_pending_save(url)
    bucket, key = _split(os.fspath(url))
    return state.client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=3600)


def torch_save(obj: Any, url: str | os.PathLike[str]) -> None:
    """``torch.save`` of `obj` to an ``s3://`` URL (one PUT)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    bucket, key = _split(os.fspath(url))
    state.client.put_object(Bucket=bucket, Key=key, Body=buffer.getvalue())


def torch_load(url: str | os.PathLike[str], *args: Any, **kwargs: Any) -> Any:
    """``torch.load`` of the object at an ``s3://`` URL (a local path is loaded as it is)."""
    if not os.fspath(url).startswith("s3://"):
        return torch.load(url, *args, **kwargs)
    return torch.load(io.BytesIO(read_bytes(url)), *args, **kwargs)


class S3Path(str):
    """An ``s3://bucket/prefix`` URL (a str, so Lightning takes it as the URL it is) with the pathlib methods the
    vendored tests call on ``tmp_path``, answered from S3 (a "directory" exists where objects lie under it)."""

    def __new__(cls, url: str | os.PathLike[str]) -> S3Path:
        text = os.fspath(url)
        _split(text)  # a valid s3:// URL
        return super().__new__(cls, text.rstrip("/"))

    def __truediv__(self, other: str | os.PathLike[str]) -> S3Path:
        return S3Path(f"{self}/{os.fspath(other).strip('/')}")

    @property
    def name(self) -> str:
        return self.rpartition("/")[2]

    @property
    def parent(self) -> S3Path:
        return S3Path(self.rpartition("/")[0])

    def iterdir(self) -> Iterator[S3Path]:
        return iter([self / name for name in listdir(self)])

    def glob(self, pattern: str) -> Iterator[S3Path]:
        if "/" in pattern:
            raise NotImplementedError(f"S3Path.glob matches names directly under the prefix only, not {pattern!r}")
        return iter([self / name for name in listdir(self) if fnmatch.fnmatchcase(name, pattern)])

    def exists(self) -> bool:
        return isfile(self) or isdir(self)

    def touch(self) -> None:  # s3: pathlib's touch of a new file is an empty object at the URL
        bucket, key = _split(self)
        state.client.put_object(Bucket=bucket, Key=key, Body=b"")


def settle(trainer: pl.Trainer) -> None:
    """Wait for the trainer's pending async saves, as docs/lightning.md says to before another reader looks at the
    checkpoint directory (a listing does not wait; a load of one URL does). Nothing to wait for in sync mode."""
    plugin = trainer.strategy.checkpoint_io
    if isinstance(plugin, S3CheckpointIO):
        plugin.wait_for_pending_saves()


# ---- the Trainer -----------------------------------------------------------------------------------------------


def make_checkpoint_io(**kwargs: Any) -> S3CheckpointIO:
    """An `S3CheckpointIO` in the current mode, torn down at the end of the test."""
    plugin = S3CheckpointIO(async_checkpointing=state.mode == "async", **kwargs)
    state.plugins.append(plugin)
    return plugin


def _gives_checkpoint_io(kwargs: dict[str, Any]) -> bool:
    plugins = kwargs.get("plugins") or []
    plugins = plugins if isinstance(plugins, (list, tuple)) else [plugins]
    strategy = kwargs.get("strategy")
    return any(isinstance(p, CheckpointIO) for p in plugins) or getattr(strategy, "_checkpoint_io", None) is not None


class Trainer(pl.Trainer):
    """Lightning's Trainer with an `S3CheckpointIO` (the current mode) where the test gives no checkpoint plugin."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not _gives_checkpoint_io(kwargs):
            plugins = kwargs.get("plugins") or []
            plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
            kwargs["plugins"] = [*plugins, make_checkpoint_io()]
        super().__init__(*args, **kwargs)


@contextlib.contextmanager
def running_test(client: Any, mode: str) -> Iterator[None]:
    """The state of one test: its client and mode; its plugins' pending saves finished (and their errors raised)
    when it ends."""
    state.client, state.mode, state.plugins = client, mode, []
    try:
        yield
    finally:
        plugins, state.plugins = state.plugins, []
        for plugin in plugins:
            plugin.teardown()
