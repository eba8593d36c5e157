"""Parse, validate, build and join ``s3://bucket/key`` URLs, using only the standard library.

This flat module is copied unedited into NeMo forks and imported by lightweight tools, so it must never import
anything outside the standard library (not even lazily).

Conventions:

* An S3 URL is a ``str`` starting with exactly ``s3://``; the key is everything after the first ``/`` that follows
  the bucket, kept character for character (unicode, spaces, ``=``, inner ``//``, a trailing ``/``).
* ``pathlib`` collapses ``//``, so ``str(Path("s3://b/k")) == "s3:/b/k"``. A path object (``os.PathLike``) whose
  text starts with ``s3:/`` is therefore taken as a collapsed S3 URL and repaired by :func:`normalize_s3_url`
  (the only place that repair lives) instead of being treated as a local path. Pathlib also drops inner ``//`` and
  a trailing ``/`` of the key, which cannot be repaired: pass such URLs as ``str``.
* Bucket names follow the Amazon S3 general-purpose naming rules unless relaxed for S3-compatible stores (MinIO,
  Ceph, SeaweedFS...) with ``strict_bucket_names=False`` or ``S3_CHECKPOINT_IO_RELAXED_BUCKET_NAMES=1``.
* What Amazon S3 accepts in place of a bucket name is accepted too, whatever the mode (:func:`bucket_kind` says
  which it is): S3 Express One Zone directory buckets (``base--usw2-az1--x-s3``), access point aliases
  (``...-s3alias``), Object Lambda access point aliases (``...--ol-s3``) and access point ARNs, general purpose
  (``arn:aws:s3:us-west-2:123456789012:accesspoint/my-ap``) or on Outposts
  (``arn:aws:s3-outposts:us-west-2:123456789012:outpost/op-01ac5d28a6a232904/accesspoint/my-ap``), in the
  ``aws``, ``aws-cn`` and ``aws-us-gov`` partitions. An ARN contains ``/``: ``s3://ARN/key`` parses to
  ``(ARN, key)`` and :func:`build_s3_url` rebuilds it.

Deliberate differences from NeMo's ``S3Utils``: :func:`parse_s3_url` raises ``ValueError`` instead of returning
``(None, None)``; :func:`is_s3_url` recognises ``Path`` objects holding a (collapsed) S3 URL instead of returning
False, and raises ``TypeError`` for types that cannot be paths; :func:`build_s3_url` returns ``s3://bucket`` (no
trailing ``/``) for an empty key and never produces ``//`` after the bucket.
"""

from __future__ import annotations

import importlib.metadata
import os
import re

__all__ = [
    "MAX_KEY_BYTES",
    "RELAXED_BUCKET_NAMES_ENV",
    "S3_PATH_PREFIX",
    "BUCKET_KINDS",
    "as_path_or_s3_url",
    "bucket_kind",
    "build_s3_url",
    "is_s3_url",
    "join_s3_url",
    "normalize_s3_url",
    "parse_s3_url",
    "s3_dir_prefix",
    "s3_url_name",
    "s3_url_parent",
    "validate_bucket_name",
]

# ---- version (shared by every module of the package; this is the lowest one) ----------------------------------------

_FALLBACK_VERSION = "0.1.0"
"""The version where no distribution metadata describes these files (copies inside a fork's package); kept equal
to pyproject.toml's by tests/test_build.py."""


def _package_version() -> str:
    """The installed distribution's version. Copies inside another package (``nemo/utils/s3_dirpath_utils.py``)
    report the constant: that environment may hold an unrelated install of the distribution."""
    if __package__:
        return _FALLBACK_VERSION
    try:
        return importlib.metadata.version("s3-checkpoint-io")
    except importlib.metadata.PackageNotFoundError:
        return _FALLBACK_VERSION


__version__ = _package_version()

S3_PATH_PREFIX = "s3://"
#: Environment variable that, set to 1/true/yes/on, relaxes bucket-name checks (read at every call).
RELAXED_BUCKET_NAMES_ENV = "S3_CHECKPOINT_IO_RELAXED_BUCKET_NAMES"
#: Amazon S3's limit on the length of an object key, in bytes of UTF-8.
MAX_KEY_BYTES = 1024

_COLLAPSED_PREFIX = "s3:/"
_STRICT_CHARSET = re.compile(r"[a-z0-9.-]+")
_IPV4_LIKE = re.compile(r"[0-9]{1,3}(\.[0-9]{1,3}){3}")
_RESERVED_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_RESERVED_SUFFIXES = (".mrap",)  # a multi-Region access point is addressed by its ARN, never by this alias
_ACCESS_POINT_ALIAS_SUFFIX = "-s3alias"
_OBJECT_LAMBDA_ALIAS_SUFFIX = "--ol-s3"
_DIRECTORY_SUFFIX = "--x-s3"
# base name, zone id (an Availability Zone such as usw2-az1, or a Local Zone such as usw2-lax1-az1), suffix
_DIRECTORY_BUCKET = re.compile(
    r"(?P<base>[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)--(?P<zone>[a-z0-9]+(?:-[a-z0-9]+)*-az[0-9]+)--x-s3"
)
_PARTITIONS = "aws|aws-cn|aws-us-gov"
_REGION = r"[a-z]{2}(?:-[a-z]+)+-[0-9]+"
_ACCOUNT = r"[0-9]{12}"
_ACCESS_POINT_NAME = r"[a-z0-9](?:[a-z0-9-]{1,48}[a-z0-9])"  # 3-50 characters, no '.', no trailing '-'
_ACCESS_POINT_ARN = re.compile(
    rf"arn:(?:{_PARTITIONS}):s3:{_REGION}:{_ACCOUNT}:accesspoint/{_ACCESS_POINT_NAME}(?=/|$)"
)
_OUTPOSTS_ACCESS_POINT_ARN = re.compile(
    rf"arn:(?:{_PARTITIONS}):s3-outposts:{_REGION}:{_ACCOUNT}:outpost/op-[0-9a-f]{{17}}/accesspoint/"
    rf"{_ACCESS_POINT_NAME}(?=/|$)"
)
_ARN_FORMS = (
    "arn:PARTITION:s3:REGION:ACCOUNT-ID:accesspoint/NAME or "
    "arn:PARTITION:s3-outposts:REGION:ACCOUNT-ID:outpost/OUTPOST-ID/accesspoint/NAME "
    "(PARTITION aws, aws-cn or aws-us-gov; a 12-digit account id; NAME of 3-50 lowercase letters, digits and '-')"
)
#: What :func:`bucket_kind` can answer.
BUCKET_KINDS = (
    "general_purpose",
    "directory",
    "access_point_alias",
    "object_lambda_alias",
    "access_point_arn",
    "outposts_access_point_arn",
)
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("", "0", "false", "no", "off")
_OPT_OUT_HINT = (
    " (for S3-compatible stores that accept other names: pass strict_bucket_names=False"
    f" or set {RELAXED_BUCKET_NAMES_ENV}=1)"
)


# ---- recognising and normalising ----------------------------------------------------------------------------------


def _path_text(path: object) -> str:
    """The text of a str or str-PathLike; TypeError for anything else, so misuse is never mistaken for "not S3"."""
    if isinstance(path, str):
        return path
    if isinstance(path, os.PathLike):
        text = os.fspath(path)
        if isinstance(text, str):
            return text
        raise TypeError(f"expected an S3 URL as str or os.PathLike[str], got a path of {type(text).__name__}")
    raise TypeError(f"expected an S3 URL as str or os.PathLike[str], got {type(path).__name__}")


def is_s3_url(path: str | os.PathLike[str] | None) -> bool:
    """Whether `path` names an S3 object: a str starting with ``s3://``, or a path object holding an S3 URL that
    pathlib collapsed to ``s3:/...``. None is False (an unset path is not S3); other types raise TypeError."""
    if path is None:
        return False
    text = _path_text(path)
    if isinstance(path, str):
        return text.startswith(S3_PATH_PREFIX)
    return text.startswith(_COLLAPSED_PREFIX)


def normalize_s3_url(path: str | os.PathLike[str]) -> str:
    """The canonical ``s3://...`` str for `path`, repairing the ``//`` that pathlib collapses in path objects.

    Only the scheme is checked here (bucket and key are checked by :func:`parse_s3_url`). Raises ValueError, naming
    the input, when `path` is not an S3 URL (exactly when :func:`is_s3_url` is False) and TypeError for other types.
    """
    text = _path_text(path)
    if isinstance(path, str):
        if text.startswith(S3_PATH_PREFIX):
            return text
        if text.startswith(_COLLAPSED_PREFIX):
            raise ValueError(
                f"{path!r} is not an S3 URL: it looks like an s3:// URL whose '//' was collapsed by pathlib "
                "(str(Path('s3://b/k')) == 's3:/b/k'); pass the URL as a str, or pass the Path object itself"
            )
        if text.lower().startswith("s3:"):
            raise ValueError(f"{path!r} is not an S3 URL: it must start with exactly {S3_PATH_PREFIX!r}")
        raise ValueError(f"{path!r} is not an S3 URL: it does not start with {S3_PATH_PREFIX!r}")
    if text.startswith(S3_PATH_PREFIX):
        return text
    if text.startswith(_COLLAPSED_PREFIX):
        return S3_PATH_PREFIX + text[len(_COLLAPSED_PREFIX) :]
    raise ValueError(f"{path!r} is not an S3 URL: its text {text!r} does not start with {S3_PATH_PREFIX!r}")


_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def as_path_or_s3_url(path: str | os.PathLike[str]) -> str:
    """A str for a path that may be local or S3: the canonical ``s3://`` URL for S3 (pathlib collapse repaired),
    else ``os.fspath(path)``. Use it wherever a path is handed on, so an S3 URL is never turned into a local path.

    Raises ValueError for text that looks like a URL but is not a valid ``s3://`` one (``s3:/b/k``, ``S3://b/k``,
    ``http://...``, ``gs://...``): taking it as a local path would silently write to the local disk.
    """
    if is_s3_url(path):
        return normalize_s3_url(path)
    text = _path_text(path)
    if text.lower().startswith("s3:") or _URL_SCHEME.match(text):
        raise ValueError(f"{path!r} is neither an s3://bucket/key URL nor a local path")
    return text


# ---- bucket names and keys ----------------------------------------------------------------------------------------


def _strict_mode(strict: bool | None) -> bool:
    """The argument if given, else the environment variable read now (so tests and tools can flip it at run time)."""
    if strict is not None:
        return bool(strict)
    value = os.environ.get(RELAXED_BUCKET_NAMES_ENV, "").strip().lower()
    if value in _TRUE_WORDS:
        return False
    if value in _FALSE_WORDS:
        return True
    raise ValueError(
        f"environment variable {RELAXED_BUCKET_NAMES_ENV}={os.environ[RELAXED_BUCKET_NAMES_ENV]!r} is not understood; "
        "use 1/true/yes/on for relaxed bucket names, or 0/false/no/off (or leave it unset) for strict ones"
    )


def _is_space_or_control(char: str) -> bool:
    code = ord(char)
    return char.isspace() or code < 0x20 or 0x7F <= code <= 0x9F or 0xD800 <= code <= 0xDFFF


def _arn_at_start(text: str) -> str | None:
    """The access point ARN that `text` starts with (followed by ``/`` or the end), or None."""
    for form in (_ACCESS_POINT_ARN, _OUTPOSTS_ACCESS_POINT_ARN):
        match = form.match(text)
        if match:
            return match.group(0)
    return None


def _bucket_problem(bucket: str, strict: bool) -> str | None:
    """Which naming rule `bucket` breaks, or None if it is valid."""
    if not bucket:
        return "the bucket name is empty"
    if bucket.startswith("arn:"):
        if _arn_at_start(bucket) == bucket:
            return None
        return f"it is not an access point ARN of the form {_ARN_FORMS}"  # in relaxed mode too: never a name
    if not strict:
        if len(bucket) > 255:
            return f"it has {len(bucket)} characters (at most 255, even with relaxed names)"
        if "/" in bucket:
            return "it contains '/'"
        bad = sorted({char for char in bucket if _is_space_or_control(char)})
        if bad:
            return f"it contains whitespace, control or surrogate characters {', '.join(map(repr, bad))}"
        return None
    if not 3 <= len(bucket) <= 63:
        return f"it has {len(bucket)} characters (must have 3 to 63)"
    if not _STRICT_CHARSET.fullmatch(bucket):
        bad = sorted(set(_STRICT_CHARSET.sub("", bucket)))
        return f"it contains {', '.join(map(repr, bad))} (only lowercase letters, digits, '.' and '-' are allowed)"
    if not (bucket[0].isalnum() and bucket[-1].isalnum()):
        return "it must begin and end with a lowercase letter or digit"
    if ".." in bucket:
        return "it contains two adjacent periods"
    if _IPV4_LIKE.fullmatch(bucket):
        return "it is formatted as an IP address"
    for prefix in _RESERVED_PREFIXES:
        if bucket.startswith(prefix):
            return f"the prefix {prefix!r} is reserved by Amazon S3"
    for suffix in _RESERVED_SUFFIXES:
        if bucket.endswith(suffix):
            return f"the suffix {suffix!r} is reserved by Amazon S3"
    if bucket.endswith(_DIRECTORY_SUFFIX):
        if "." in bucket:
            return "it contains '.', which directory bucket names (ending in '--x-s3') may not"
        if not _DIRECTORY_BUCKET.fullmatch(bucket):
            return "a directory bucket name must have the form BASE--ZONE-ID--x-s3 (e.g. 'my-ckpt--usw2-az1--x-s3')"
    return None


def bucket_kind(bucket: str, *, strict: bool | None = None) -> str:
    """Which of `BUCKET_KINDS` `bucket` (as found in ``s3://BUCKET/key``) is; ValueError if it is not a valid name.

    ``"directory"``: an S3 Express One Zone directory bucket (``base--usw2-az1--x-s3``): listings need ``/``-ending
    prefixes and come unordered, ETags are not MD5 digests, requests must be virtual-hosted style.
    ``"access_point_alias"`` / ``"object_lambda_alias"``: usable wherever a bucket name is. ``"access_point_arn"``
    / ``"outposts_access_point_arn"``: an ARN, which boto3 accepts as ``Bucket=`` (virtual-hosted style only).
    Anything else valid is ``"general_purpose"`` (including relaxed names of S3-compatible stores).
    """
    validate_bucket_name(bucket, strict=strict)
    if bucket.startswith("arn:") and _arn_at_start(bucket) == bucket:
        return "outposts_access_point_arn" if ":s3-outposts:" in bucket else "access_point_arn"
    if _DIRECTORY_BUCKET.fullmatch(bucket):
        return "directory"
    if bucket.endswith(_OBJECT_LAMBDA_ALIAS_SUFFIX):
        return "object_lambda_alias"
    if bucket.endswith(_ACCESS_POINT_ALIAS_SUFFIX):
        return "access_point_alias"
    return "general_purpose"


def validate_bucket_name(bucket: str, *, strict: bool | None = None) -> str:
    """Return `bucket` if it is a valid bucket name, else raise ValueError saying which rule it breaks.

    Strict (default) applies the Amazon S3 general-purpose bucket rules; directory bucket names
    (``base--zone-id--x-s3``), access point aliases (``...-s3alias``, ``...--ol-s3``) and access point ARNs pass in
    both modes (see :func:`bucket_kind`).
    Relaxed (``strict=False``, or env ``S3_CHECKPOINT_IO_RELAXED_BUCKET_NAMES=1`` when `strict` is None) only
    requires 1-255 characters, no ``/``, no whitespace, control or surrogate characters.
    """
    if not isinstance(bucket, str):
        raise TypeError(f"bucket must be a str, got {type(bucket).__name__}")
    is_strict = _strict_mode(strict)
    problem = _bucket_problem(bucket, is_strict)
    if problem is not None:
        hint = _OPT_OUT_HINT if is_strict and not bucket.startswith("arn:") else ""
        raise ValueError(f"invalid S3 bucket name {bucket!r}: {problem}{hint}")
    return bucket


def _key_problem(key: str) -> str | None:
    """Why `key` cannot be an S3 object key (not UTF-8 encodable, or longer than 1024 bytes), or None."""
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError as exc:
        return f"the key cannot be encoded as UTF-8 (lone surrogate at position {exc.start})"
    if size > MAX_KEY_BYTES:
        return f"the key is {size} bytes in UTF-8 (S3 allows at most {MAX_KEY_BYTES})"
    return None


# ---- parsing and building -----------------------------------------------------------------------------------------


def parse_s3_url(url: str | os.PathLike[str], *, strict_bucket_names: bool | None = None) -> tuple[str, str]:
    """Split an S3 URL into ``(bucket, key)``; the key is kept exactly and is ``""`` for ``s3://bucket[/]``.

    Raises ValueError, naming the input, for anything that is not a valid S3 URL (other schemes, ``s3:/x`` as a
    str, an empty or invalid bucket, a key over 1024 UTF-8 bytes or not encodable as UTF-8) and TypeError for types
    other than str / os.PathLike (None included). See :func:`validate_bucket_name` for `strict_bucket_names`.
    """
    normalized = normalize_s3_url(url)
    rest = normalized[len(S3_PATH_PREFIX) :]
    arn = _arn_at_start(rest)
    if arn is not None:
        bucket, key = arn, rest[len(arn) + 1 :]
    else:
        bucket, _, key = rest.partition("/")
    is_strict = _strict_mode(strict_bucket_names)
    problem = _bucket_problem(bucket, is_strict)
    if problem is not None:
        hint = _OPT_OUT_HINT if is_strict and bucket and not bucket.startswith("arn:") else ""
        raise ValueError(f"{url!r} is not a valid S3 URL: bucket {bucket!r}: {problem}{hint}")
    problem = _key_problem(key)
    if problem is not None:
        raise ValueError(f"{url!r} is not a valid S3 URL: {problem}")
    return bucket, key


def build_s3_url(bucket: str, key: str = "", *, strict_bucket_names: bool | None = None) -> str:
    """``s3://bucket/key`` (``s3://bucket`` for an empty key), validating bucket and key.

    Leading ``/`` of `key` are dropped so the result never has ``//`` after the bucket; S3 keys that really begin
    with ``/`` therefore cannot be built with this helper. Otherwise the key is kept exactly, and
    ``parse_s3_url(build_s3_url(b, k)) == (b, k)``.
    """
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, got {type(key).__name__}")
    validate_bucket_name(bucket, strict=strict_bucket_names)
    key = key.lstrip("/")
    problem = _key_problem(key)
    if problem is not None:
        raise ValueError(f"cannot build an S3 URL for bucket {bucket!r} and key {key!r}: {problem}")
    return f"{S3_PATH_PREFIX}{bucket}/{key}" if key else f"{S3_PATH_PREFIX}{bucket}"


def join_s3_url(base: str | os.PathLike[str], *parts: str, strict_bucket_names: bool | None = None) -> str:
    """Append `parts` to the S3 URL `base` with exactly one ``/`` at each boundary (only the slashes at the
    boundary are merged; inner ``//`` and a trailing ``/`` on the last part are kept). Empty parts are skipped.

    Unlike ``posixpath.join``, a part that is itself an ``s3://`` URL raises ValueError instead of replacing the
    base, and a part starting with ``/`` is still appended. The result is validated like :func:`parse_s3_url`.
    """
    result = normalize_s3_url(base)
    parse_s3_url(result, strict_bucket_names=strict_bucket_names)
    for part in parts:
        if not isinstance(part, str):
            raise TypeError(f"parts to join must be str, got {type(part).__name__}")
        if part.startswith(S3_PATH_PREFIX):
            raise ValueError(f"cannot join the absolute S3 URL {part!r} onto {result!r}")
        if part:
            result = result.rstrip("/") + "/" + part.lstrip("/")
    parse_s3_url(result, strict_bucket_names=strict_bucket_names)
    return result


# ---- directory-style helpers --------------------------------------------------------------------------------------


def s3_url_parent(url: str | os.PathLike[str], *, strict_bucket_names: bool | None = None) -> str:
    """The URL of the "directory" holding `url`, without a trailing ``/``.

    ``s3://b/a/c.ckpt`` -> ``s3://b/a``; a trailing ``/`` marks a directory, so ``s3://b/a/`` -> ``s3://b``;
    the bucket root is its own parent (like ``posixpath.dirname("/")``).
    """
    bucket, key = parse_s3_url(url, strict_bucket_names=strict_bucket_names)
    parent_key = key.rstrip("/").rpartition("/")[0].rstrip("/")
    return f"{S3_PATH_PREFIX}{bucket}/{parent_key}" if parent_key else f"{S3_PATH_PREFIX}{bucket}"


def s3_url_name(url: str | os.PathLike[str], *, strict_bucket_names: bool | None = None) -> str:
    """The last segment of the key, ignoring a trailing ``/`` (``s3://b/a/c.ckpt`` -> ``c.ckpt``, ``s3://b/a/``
    -> ``a``); ``""`` for the bucket root."""
    _, key = parse_s3_url(url, strict_bucket_names=strict_bucket_names)
    return key.rstrip("/").rpartition("/")[2]


def s3_dir_prefix(url: str | os.PathLike[str], *, strict_bucket_names: bool | None = None) -> tuple[str, str]:
    """``(bucket, prefix)`` for listing the "directory" `url`: the key with exactly one trailing ``/`` (``""`` for
    the bucket root), so ``s3://b/ckpt`` lists ``ckpt/...`` but not ``ckpt_old/...``."""
    bucket, key = parse_s3_url(url, strict_bucket_names=strict_bucket_names)
    return bucket, (key.rstrip("/") + "/" if key else "")


# ---- prefix spreading's directories (s3_prefix_spreading lays them out; s3_utils paces each apart) ------------------

SPREAD_SEGMENT_PREFIX = "s3ckpt-spread-"  # Package-internal (docs/api.md)
"""The start of a spread directory's key segment; its hexadecimal index follows (``run/s3ckpt-spread-03/``).
Package-internal (docs/api.md)."""


def spread_prefix(key: str) -> str:
    """`key` up to and including its first spread segment (``run/s3ckpt-spread-03/`` for
    ``run/s3ckpt-spread-03/step-200/__3_0.distcp``, also for the directory ``run/s3ckpt-spread-03/``); ``""`` for a
    key in no spread directory. S3 serves each such prefix from a partition of its own once it has split them, so the
    request pacer paces each apart (`s3_utils.request_pacer`). Package-internal (docs/api.md)."""
    parts = key.split("/")
    for index, part in enumerate(parts[:-1]):
        if part.startswith(SPREAD_SEGMENT_PREFIX):
            return "/".join(parts[: index + 1]) + "/"
    return ""
