"""Reliability under injected faults: a checkpoint save either succeeds, or fails loudly, and never costs the user the
last good checkpoint.

Every scenario runs `S3CheckpointIO` against the real local S3 server (moto or SeaweedFS) through the fault-injecting
proxy of ``fault_proxy``, with synchronous and asynchronous saves, a fast `RetryPolicy` and 5 MiB parts. What
"nothing lost" means in each test: the previous checkpoint (at the same key, or a different one that was scheduled for
removal) is still there byte for byte and loads to identical tensors, and no multipart upload is left open.

Set ``S3CKPT_RELIABILITY_LEDGER=/path/file`` to have each scenario append a line
``backend | scenario | injected faults | outcome | data lost`` (the numbers quoted in reports come from it).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch
from botocore.exceptions import ClientError, NoCredentialsError
from fault_proxy import Fault, FaultProxy, FaultRule
from s3_servers import S3Endpoint, seaweedfs_process

from s3_checkpoint_io import S3CheckpointIO
from s3_fencing import OWNER_RECORD_NAME as OWNER_RECORD
from s3_pacing import is_retriable_error
from s3_utils import (
    ChecksumMismatchError,
    RetryPolicy,
    S3ClientSettings,
    is_throttling_error,
    store_capabilities,
)

MiB = 1024 * 1024
MODES = ("sync", "async")
#: Transient faults: enough attempts that every injected burst is absorbed, backoff short enough for a fast suite.
FAST = RetryPolicy(max_attempts=6, max_elapsed_s=20.0, initial_backoff_s=0.01, max_backoff_s=0.05)
#: Persistent faults: a small, known budget that the failure must respect.
PERSISTENT = RetryPolicy(max_attempts=4, max_elapsed_s=3.0, initial_backoff_s=0.01, max_backoff_s=0.05)
#: The query of CreateMultipartUpload (``?uploads``), not of UploadPart/Complete (``?uploadId=...``).
CREATE_UPLOAD_QUERY = r"(^|&)uploads(=|&|$)"


# ---- helpers --------------------------------------------------------------------------------------------------------


def ledger(server: S3Endpoint, scenario: str, faults: str, outcome: str, lost: str = "none") -> None:
    """Append one result line to the file named by ``S3CKPT_RELIABILITY_LEDGER`` (no-op when unset)."""
    path = os.environ.get("S3CKPT_RELIABILITY_LEDGER")
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(" | ".join([server.name, scenario, faults, outcome, lost]) + "\n")


def make_checkpoint(seed: int, mib: float) -> dict[str, Any]:
    """A checkpoint with `mib` MiB of float32 weights (12 MiB: three 5 MiB parts, the last one short)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "state_dict": {"weight": torch.randn(int(mib * MiB) // 4, generator=generator), "bias": torch.arange(7.0)},
        "global_step": seed,
    }


def assert_same_checkpoint(loaded: dict[str, Any], expected: dict[str, Any]) -> None:
    """Loaded tensors are bit-identical to the saved ones."""
    assert loaded["global_step"] == expected["global_step"]
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(loaded["state_dict"][name], tensor), name


def object_digest(s3_client: Any, bucket: str, key: str) -> str:
    """SHA-256 of the stored object, read with a plain client (not through the proxy)."""
    return hashlib.sha256(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read()).hexdigest()


def open_uploads(s3_client: Any, bucket: str) -> list[str]:
    """Keys of the multipart uploads still open in `bucket`."""
    return [upload["Key"] for upload in s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def checkpoint_keys(s3_client: Any, bucket: str) -> list[str]:
    """Object keys in `bucket`, checksum and owner records left out."""
    contents = s3_client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return sorted(obj["Key"] for obj in contents if not obj["Key"].endswith((".s3ckpt-checksum.json", OWNER_RECORD)))


def rendered(exc: BaseException) -> str:
    """What a traceback's last lines show for `exc`: type, message and notes."""
    return "".join(traceback.format_exception_only(type(exc), exc))


def error_chain(exc: BaseException) -> list[BaseException]:
    """`exc` and every exception it was raised from or while handling."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def error_code(exc: BaseException) -> str | None:
    """The S3 error code of a botocore ClientError, else None."""
    return exc.response.get("Error", {}).get("Code") if isinstance(exc, ClientError) else None


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `condition` every 10 ms; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.01)


def save_and_wait(plugin: S3CheckpointIO, checkpoint: dict[str, Any], url: str) -> None:
    """Save; in async mode also wait until the checkpoint is durable (raising a background failure)."""
    plugin.save_checkpoint(checkpoint, url)
    if plugin.async_checkpointing:
        plugin.wait_for_pending_saves()


def start_save(plugin: S3CheckpointIO, checkpoint: dict[str, Any], url: str) -> Callable[[], None]:
    """Start a save without waiting for it (sync saves run in a helper thread); the returned function waits for it
    and raises its error, so a test can act on the server while the save is in flight."""
    if plugin.async_checkpointing:
        plugin.save_checkpoint(checkpoint, url)
        return plugin.wait_for_pending_saves
    errors: list[BaseException] = []

    def run() -> None:
        try:
            plugin.save_checkpoint(checkpoint, url)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, name="test-sync-save", daemon=True)
    thread.start()

    def finish() -> None:
        thread.join(120)
        assert not thread.is_alive(), "the save did not finish within 120 s"
        if errors:
            raise errors[0]

    return finish


# ---- fixtures -------------------------------------------------------------------------------------------------------


@pytest.fixture
def s3_client(s3_server: S3Endpoint) -> Any:
    """A plain client for assertions (overrides conftest's): botocore's response checksum check is off, because moto
    reports a full-object checksum for multipart objects that does not match their bytes (this package's own reader
    then relies on its checksum record; the digests below compare the bytes themselves)."""
    return s3_server.client(response_checksum_validation="when_required")


@pytest.fixture
def make_plugin(fault_proxy: FaultProxy, bucket: str) -> Iterator[Callable[..., S3CheckpointIO]]:
    """Build `S3CheckpointIO` plugins that talk to the server through the proxy; torn down (errors ignored) after."""
    plugins: list[S3CheckpointIO] = []

    def build(mode: str, policy: RetryPolicy = FAST, **kwargs: Any) -> S3CheckpointIO:
        settings = S3ClientSettings(
            endpoint_url=fault_proxy.endpoint_url,
            # Wide enough for SeaweedFS on a busy CI machine (two test workers on two cores answer in seconds at
            # times); no test here waits on a hung read: stalls end in a dropped connection.
            read_timeout_s=10,
            connect_timeout_s=2,
            max_pool_connections=16,
            user_agent_extra=f"reliability-{uuid.uuid4().hex[:8]}",  # a fresh client: no connection reuse across tests
        )
        plugin = S3CheckpointIO(
            f"s3://{bucket}/run",
            chunk_size_MB=5,
            max_write_concurrency=2,
            max_read_concurrency=3,
            async_checkpointing=mode == "async",
            client_settings=settings,
            retry_policy=policy,
            **kwargs,
        )
        plugins.append(plugin)
        return plugin

    yield build
    for plugin in plugins:
        with contextlib.suppress(Exception):
            plugin.teardown()


class Outage:
    """Takes the S3 server away in the middle of a test and brings it back.

    SeaweedFS: SIGKILL of the ``weed`` process (no shutdown, no flush) and a restart on the same port and data
    directory, which keeps its objects and open multipart uploads. moto keeps everything in memory, so killing it
    would lose the very data the test checks; there the outage is emulated by the proxy resetting every connection
    (what a client sees while a server is down behind a load balancer that drops connections).
    """

    def __init__(self, server: S3Endpoint, proxy: FaultProxy) -> None:
        self._proxy = proxy
        try:
            self._weed = seaweedfs_process(server)
        except KeyError:
            self._weed = None
        self._rule: FaultRule | None = None
        self._first_request = 0
        self.active = False

    @property
    def kind(self) -> str:
        return "SIGKILL + restart of weed" if self._weed is not None else "every connection reset (moto emulation)"

    def begin(self) -> None:
        self._first_request = len(self._proxy.requests)
        if self._weed is not None:
            self._weed.kill()
        else:
            self._rule = self._proxy.add_rule(FaultRule(Fault.reset_before_response()))
        self.active = True

    def restart_unseen(self) -> None:
        """Bring the server back while clients still see it down, so that `end` then takes no time.

        A restart of weed takes about 1 s on an idle machine and several on a loaded one (CI runs two test workers
        on two cores). A test that must end the outage at a precise point (inside an abort's retry budget) restarts
        weed first behind the proxy, which answers every request 502 as it does while weed is dead. moto's outage
        is the proxy's already: nothing to do.
        """
        if self._weed is not None and self.active and not self._weed.alive:
            self._rule = self._proxy.add_rule(FaultRule(Fault.status(502, "InternalError", "Bad Gateway")))
            self._weed.restart()

    def end(self) -> None:
        if not self.active:
            return
        self.active = False
        if self._weed is not None and not self._weed.alive:
            self._weed.restart()
        if self._rule is not None:
            self._proxy.remove_rule(self._rule)
            self._rule = None

    def failed_requests(self) -> int:
        """Requests since `begin` that got no answer or a 5xx (502 from the proxy while weed is down)."""
        return sum(1 for r in self._proxy.requests[self._first_request :] if r.status is None or r.status >= 500)


@pytest.fixture
def outage(s3_server: S3Endpoint, fault_proxy: FaultProxy) -> Iterator[Outage]:
    """An `Outage` of the session's server; the server is always brought back, even when the test fails."""
    if s3_server.name == "external":
        pytest.skip("an external endpoint cannot be taken down by the suite")
    control = Outage(s3_server, fault_proxy)
    try:
        yield control
    finally:
        control.end()


# ---- transient bursts -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_transient_bursts_are_absorbed_and_every_retry_is_counted(
    mode: str,
    make_plugin: Callable[..., S3CheckpointIO],
    fault_proxy: FaultProxy,
    s3_client: Any,
    bucket: str,
    s3_server: S3Endpoint,
) -> None:
    plugin = make_plugin(mode)
    older_url, url = f"s3://{bucket}/run/step=1.ckpt", f"s3://{bucket}/run/step=2.ckpt"
    older, newer = make_checkpoint(1, 1), make_checkpoint(2, 12)
    save_and_wait(plugin, older, older_url)
    rules = [
        # ~30% of part uploads answered 503 SlowDown (seeded, capped so one part never exhausts its attempts)
        FaultRule(Fault.slow_down(), method="PUT", query="partNumber=", probability=0.3, seed=4, times=4),
        FaultRule(Fault.status(500, "InternalError"), method="POST", query_regex=CREATE_UPLOAD_QUERY, times=1),
        FaultRule(Fault.reset_before_response(), method="POST", query="uploadId=", times=1),  # CompleteMultipartUpload
        FaultRule(Fault.slow_down(), method="HEAD", times=1),
        # ~30% of ranged GETs cut off after 64 KiB by a connection reset
        FaultRule(
            Fault.reset_mid_response(after_bytes=64 * 1024),
            method="GET",
            path_regex=r"step=2\.ckpt$",
            probability=0.3,
            seed=8,
            times=2,
        ),
    ]
    for rule in rules:
        fault_proxy.add_rule(rule)

    save_and_wait(plugin, newer, url)
    assert_same_checkpoint(plugin.load_checkpoint(url), newer)

    faulted = fault_proxy.count(faulted=True)
    assert faulted == sum(rule.fired for rule in rules)
    assert all(rule.fired <= (rule.times or 0) for rule in rules)
    assert faulted >= 6, [rule.fired for rule in rules]  # the seeds make at least 2 + 1 + 1 + 1 + 1 fire
    assert plugin.s3.retries == faulted, "every faulted request must cost exactly one retry, no more"
    assert open_uploads(s3_client, bucket) == []
    assert_same_checkpoint(plugin.load_checkpoint(older_url), older)
    ledger(
        s3_server,
        f"transient bursts, {mode} save+load",
        f"{faulted} ({', '.join(f'{r.action.describe()}x{r.fired}' for r in rules)})",
        f"save+load OK, {plugin.s3.retries} retries",
    )


# ---- persistent failures --------------------------------------------------------------------------------------------

PERSISTENT_FAULTS: dict[str, Callable[[], FaultRule]] = {
    "create-503": lambda: FaultRule(Fault.slow_down(), method="POST", query_regex=CREATE_UPLOAD_QUERY),
    "part-500": lambda: FaultRule(Fault.status(500, "InternalError"), method="PUT", query="partNumber="),
    "part-reset": lambda: FaultRule(Fault.reset_mid_request(), method="PUT", query="partNumber="),
    "complete-503": lambda: FaultRule(Fault.status(503, "ServiceUnavailable"), method="POST", query="uploadId="),
}


@pytest.mark.parametrize("phase", sorted(PERSISTENT_FAULTS))
@pytest.mark.parametrize("mode", MODES)
def test_persistent_failure_fails_within_budget_and_keeps_the_previous_checkpoint(
    mode: str,
    phase: str,
    make_plugin: Callable[..., S3CheckpointIO],
    fault_proxy: FaultProxy,
    s3_client: Any,
    bucket: str,
    s3_server: S3Endpoint,
) -> None:
    plugin = make_plugin(mode, PERSISTENT)
    url = f"s3://{bucket}/run/last.ckpt"  # overwritten at every save, like Lightning's save_last
    previous = make_checkpoint(1, 6)
    save_and_wait(plugin, previous, url)
    digest = object_digest(s3_client, bucket, "run/last.ckpt")

    rule = fault_proxy.add_rule(PERSISTENT_FAULTS[phase]())
    started = time.monotonic()
    with pytest.raises(Exception) as raised:
        save_and_wait(plugin, make_checkpoint(2, 12), url)
    elapsed = time.monotonic() - started
    fault_proxy.remove_rule(rule)

    # The original S3 error, not tenacity's RetryError, annotated with the URL. (torch.save may wrap an error raised
    # while it is still writing: see test_s3_error_raised_while_torch_save_writes_reaches_the_caller_as_itself.)
    originals = [e for e in error_chain(raised.value) if is_retriable_error(e)]
    assert originals, f"no original S3 error in {error_chain(raised.value)!r}"
    assert url in rendered(originals[0])
    if rule.action.kind == "status":
        assert error_code(originals[0]) == rule.action.s3_error_code
    # Bounded: at most max_attempts per request kind and part (3 parts), within the time budget of the calls. A
    # throttling answer (503) uses up no attempt: it is bounded by max_elapsed_s without a success instead.
    assert rule.fired > 0
    if not is_throttling_error(originals[0]):
        assert rule.fired <= PERSISTENT.max_attempts * 3
    assert elapsed < 2 * PERSISTENT.max_elapsed_s + 3
    # Nothing lost: the older object at the same key is untouched, no upload left open.
    assert open_uploads(s3_client, bucket) == []
    assert object_digest(s3_client, bucket, "run/last.ckpt") == digest
    assert_same_checkpoint(plugin.load_checkpoint(url), previous)
    ledger(
        s3_server,
        f"persistent {phase}, {mode} save",
        f"{rule.fired} x {rule.action.describe()}",
        f"raised {type(originals[0]).__name__}"
        f"{'(' + str(error_code(originals[0])) + ')' if error_code(originals[0]) else ''} after {elapsed:.2f} s",
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cause", ["access-denied", "no-such-bucket"])
def test_s3_error_raised_while_torch_save_writes_reaches_the_caller_as_itself(
    mode: str,
    cause: str,
    make_plugin: Callable[..., S3CheckpointIO],
    fault_proxy: FaultProxy,
    bucket: str,
    s3_server: S3Endpoint,
) -> None:
    """CreateMultipartUpload runs inside ``torch.save``'s first write of a full part: its error must come out as is."""
    plugin = make_plugin(mode, PERSISTENT)
    if cause == "access-denied":
        fault_proxy.add_rule(
            FaultRule(
                Fault.status(403, "AccessDenied", "Access Denied"), method="POST", query_regex=CREATE_UPLOAD_QUERY
            )
        )
        url, expected = f"s3://{bucket}/run/denied.ckpt", ClientError
    else:
        if s3_server.name == "seaweedfs":
            pytest.skip("SeaweedFS creates a missing bucket on the first write")
        url, expected = f"s3://missing-{uuid.uuid4().hex[:12]}/run/x.ckpt", FileNotFoundError
    with pytest.raises(expected) as raised:
        save_and_wait(plugin, make_checkpoint(2, 12), url)
    assert url in rendered(raised.value)


# ---- the server dies in the middle of a save ------------------------------------------------------------------------


def _hold_second_part(proxy: FaultProxy) -> FaultRule:
    """Stall the second part upload for 1 s (then drop it: the client retries) so the outage starts mid-save."""
    return proxy.add_rule(FaultRule(Fault.stall(1.0), method="PUT", query="partNumber=", after_requests=1, times=1))


@pytest.mark.parametrize("mode", MODES)
def test_server_killed_mid_save_and_back_within_the_budget(
    mode: str,
    make_plugin: Callable[..., S3CheckpointIO],
    fault_proxy: FaultProxy,
    outage: Outage,
    s3_client: Any,
    bucket: str,
    s3_server: S3Endpoint,
) -> None:
    plugin = make_plugin(
        mode, RetryPolicy(max_attempts=200, max_elapsed_s=30, initial_backoff_s=0.05, max_backoff_s=0.3)
    )
    older_url, url = f"s3://{bucket}/run/step=1.ckpt", f"s3://{bucket}/run/step=2.ckpt"
    older, newer = make_checkpoint(1, 6), make_checkpoint(2, 15)
    save_and_wait(plugin, older, older_url)

    gate = _hold_second_part(fault_proxy)
    finish = start_save(plugin, newer, url)
    wait_for(lambda: gate.fired == 1, 20, "the second part upload")
    outage.begin()
    wait_for(lambda: outage.failed_requests() >= 3, 20, "requests failing during the outage")
    down_for = outage.failed_requests()
    outage.end()
    finish()

    verifier = make_plugin("sync")
    assert_same_checkpoint(verifier.load_checkpoint(url), newer)
    assert_same_checkpoint(verifier.load_checkpoint(older_url), older)
    assert open_uploads(s3_client, bucket) == []
    assert plugin.s3.retries >= 3
    ledger(
        s3_server,
        f"server dies mid-save, back within budget, {mode}",
        f"{outage.kind}; {down_for}+ requests failed",
        f"save OK after {plugin.s3.retries} retries, loads bit-identical",
    )


@pytest.mark.parametrize("mode", MODES)
def test_server_down_longer_than_the_budget_fails_loudly_and_loses_nothing(
    mode: str,
    make_plugin: Callable[..., S3CheckpointIO],
    fault_proxy: FaultProxy,
    outage: Outage,
    s3_client: Any,
    bucket: str,
    s3_server: S3Endpoint,
) -> None:
    policy = RetryPolicy(max_attempts=1000, max_elapsed_s=3.0, initial_backoff_s=0.05, max_backoff_s=0.2)
    plugin = make_plugin(mode, policy)
    older_url, url = f"s3://{bucket}/run/step=1.ckpt", f"s3://{bucket}/run/last.ckpt"
    older, previous = make_checkpoint(1, 1), make_checkpoint(2, 6)
    save_and_wait(plugin, older, older_url)
    save_and_wait(plugin, previous, url)
    digests = {key: object_digest(s3_client, bucket, key) for key in ("run/step=1.ckpt", "run/last.ckpt")}

    gate = _hold_second_part(fault_proxy)
    started = time.monotonic()
    finish = start_save(plugin, make_checkpoint(3, 15), url)
    if mode == "async":
        plugin.remove_checkpoint(older_url)  # ModelCheckpoint's clean-up: deferred behind the save, dropped if it fails
    wait_for(lambda: gate.fired == 1, 20, "the second part upload")
    outage.begin()
    wait_for(lambda: outage.failed_requests() >= 1, 20, "requests failing during the outage")
    # Down, as the client sees it, until the save has given up and started to abort its multipart upload; the abort
    # has a budget of its own, and the server comes back inside it (weed restarts meanwhile, during the save's).
    outage.restart_unseen()
    wait_for(lambda: fault_proxy.count(method="DELETE", query_contains="uploadId=") >= 1, 30, "the abort")
    outage.end()
    with pytest.raises(Exception) as raised:
        finish()
    elapsed = time.monotonic() - started

    originals = [e for e in error_chain(raised.value) if is_retriable_error(e)]
    assert originals, f"no original S3 error in {error_chain(raised.value)!r}"
    assert url in rendered(originals[0])
    assert elapsed < 4 * policy.max_elapsed_s + 10
    assert open_uploads(s3_client, bucket) == [], "the abort must be retried until the server is back"
    assert {key: object_digest(s3_client, bucket, key) for key in digests} == digests
    verifier = make_plugin("sync")
    assert_same_checkpoint(verifier.load_checkpoint(url), previous)
    assert_same_checkpoint(verifier.load_checkpoint(older_url), older)
    ledger(
        s3_server,
        f"server down past the budget, {mode}",
        f"{outage.kind}; {outage.failed_requests()} requests failed",
        f"raised {type(originals[0]).__name__} after {elapsed:.1f} s; abort retried OK",
    )


# ---- bad bytes on the way back --------------------------------------------------------------------------------------

BAD_READS: dict[str, Callable[[], Fault]] = {
    "corrupt": lambda: Fault.corrupt_body(offset=4321),
    "truncate": lambda: Fault.truncate_body(70_000),
    "reset": lambda: Fault.reset_mid_response(after_bytes=70_000),
}


@pytest.mark.parametrize("mib", [1, 12], ids=["one-get", "ranged-gets"])
@pytest.mark.parametrize("kind", sorted(BAD_READS))
def test_corrupted_or_truncated_reads_never_become_a_state_dict(
    kind: str,
    mib: int,
    make_plugin: Callable[..., S3CheckpointIO],
    fault_proxy: FaultProxy,
    bucket: str,
    s3_server: S3Endpoint,
) -> None:
    plugin = make_plugin("sync", PERSISTENT)
    url = f"s3://{bucket}/run/model.ckpt"
    checkpoint = make_checkpoint(5, mib)
    save_and_wait(plugin, checkpoint, url)
    rule = fault_proxy.add_rule(FaultRule(BAD_READS[kind](), method="GET", path_regex=r"model\.ckpt$"))

    with pytest.raises(Exception) as raised:
        plugin.load_checkpoint(url)
    if kind == "corrupt":
        assert isinstance(raised.value, ChecksumMismatchError)
        assert plugin.s3.retries == 0  # detected after the download; never retried into a silent success
    else:
        assert is_retriable_error(raised.value)  # a size error: retried up to the budget, then raised as is
        assert plugin.s3.retries >= PERSISTENT.max_attempts - 1
    assert url in rendered(raised.value)

    fault_proxy.remove_rule(rule)
    assert_same_checkpoint(plugin.load_checkpoint(url), checkpoint)  # the stored object itself was never harmed
    ledger(
        s3_server,
        f"{kind} GET on load ({mib} MiB)",
        f"{rule.fired} x {rule.action.describe()}",
        f"load_checkpoint raised {type(raised.value).__name__}, no state dict",
    )


# ---- async: failures are never lost, removals wait -------------------------------------------------------------------


def test_async_failure_surfaces_at_the_next_save_and_cancels_the_deferred_removal(
    make_plugin: Callable[..., S3CheckpointIO],
    fault_proxy: FaultProxy,
    s3_client: Any,
    bucket: str,
    s3_server: S3Endpoint,
) -> None:
    plugin = make_plugin("async", PERSISTENT, max_saves_in_flight=2)
    urls = {step: f"s3://{bucket}/run/step={step}.ckpt" for step in (1, 2, 3, 4, 5)}
    first = make_checkpoint(1, 1)
    save_and_wait(plugin, first, urls[1])
    rule = fault_proxy.add_rule(
        FaultRule(Fault.status(500, "InternalError"), method="PUT", path_regex=r"step=3\.ckpt$")
    )
    plugin.save_checkpoint(make_checkpoint(2, 1), urls[2])
    plugin.save_checkpoint(make_checkpoint(3, 1), urls[3])  # fails in the background
    plugin.remove_checkpoint(urls[1])  # deferred until saves 2 and 3 are durable; 3 never is
    wait_for(lambda: not plugin._pending, 30, "the background saves")  # private: no public "is idle" yet

    with pytest.raises(ClientError) as raised:
        plugin.save_checkpoint(make_checkpoint(4, 1), urls[4])
    assert error_code(raised.value) == "InternalError"
    assert urls[3] in rendered(raised.value)
    assert rule.fired == PERSISTENT.max_attempts
    assert checkpoint_keys(s3_client, bucket) == ["run/step=1.ckpt", "run/step=2.ckpt"]
    assert_same_checkpoint(plugin.load_checkpoint(urls[1]), first)
    plugin.teardown()  # reported once, not again
    fault_proxy.remove_rule(rule)
    save_and_wait(plugin, make_checkpoint(5, 1), urls[5])  # and the plugin keeps working
    ledger(
        s3_server,
        "async save fails in the background",
        f"{rule.fired} x {rule.action.describe()}",
        "raised at the next save_checkpoint; deferred removal of step=1 dropped",
    )


def test_async_failures_of_two_saves_are_both_reported(
    make_plugin: Callable[..., S3CheckpointIO],
    fault_proxy: FaultProxy,
    bucket: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    plugin = make_plugin("async", PERSISTENT, max_saves_in_flight=2)
    fault_proxy.add_rule(FaultRule(Fault.status(500, "InternalError"), method="PUT", path_regex=r"/a\.ckpt$"))
    fault_proxy.add_rule(FaultRule(Fault.status(403, "AccessDenied"), method="PUT", path_regex=r"/b\.ckpt$"))
    plugin.save_checkpoint(make_checkpoint(1, 1), f"s3://{bucket}/run/a.ckpt")
    plugin.save_checkpoint(make_checkpoint(2, 1), f"s3://{bucket}/run/b.ckpt")
    with pytest.raises(ClientError) as raised:
        plugin.teardown()
    text = caplog.text
    reported = {error_code(raised.value)} | {code for code in ("InternalError", "AccessDenied") if code in text}
    assert reported == {"InternalError", "AccessDenied"}, "the second failure must at least be logged"
    assert f"s3://{bucket}/run/a.ckpt" in text and f"s3://{bucket}/run/b.ckpt" in text


def test_a_failed_async_save_is_raised_at_teardown_even_when_its_callback_runs_late(
    make_plugin: Callable[..., S3CheckpointIO], fault_proxy: FaultProxy, bucket: str
) -> None:
    """The done-callback may be scheduled after the thread waiting in teardown wakes up; 0.3 s makes that certain."""
    plugin = make_plugin("async", PERSISTENT)
    record_outcome = plugin._on_save_done

    def late_callback(future: Any) -> None:
        time.sleep(0.3)
        record_outcome(future)

    plugin._on_save_done = late_callback  # type: ignore[method-assign]
    fault_proxy.add_rule(FaultRule(Fault.status(500, "InternalError"), method="PUT"))
    plugin.save_checkpoint(make_checkpoint(1, 0.01), f"s3://{bucket}/run/lost.ckpt")
    with pytest.raises(ClientError, match="InternalError"):
        plugin.teardown()


def test_removal_right_after_a_failed_save_never_deletes_the_older_checkpoint(
    make_plugin: Callable[..., S3CheckpointIO], fault_proxy: FaultProxy, s3_client: Any, bucket: str,
    s3_server: S3Endpoint,
) -> None:  # fmt: skip
    """ModelCheckpoint removes the previous top-k checkpoint right after asking for the new one. If the new save has
    already failed but its bookkeeping has not run yet (a thread-scheduling window, widened here to 0.5 s), the
    removal must still wait for it and then be dropped."""
    plugin = make_plugin("async", PERSISTENT)
    older_url, newer_url = f"s3://{bucket}/run/step=1.ckpt", f"s3://{bucket}/run/step=2.ckpt"
    older = make_checkpoint(1, 1)
    save_and_wait(plugin, older, older_url)
    record_outcome = plugin._on_save_done

    def late_callback(future: Any) -> None:
        time.sleep(0.5)
        record_outcome(future)

    plugin._on_save_done = late_callback  # type: ignore[method-assign]
    rule = fault_proxy.add_rule(FaultRule(Fault.status(500, "InternalError"), method="PUT", path_regex=r"step=2"))
    plugin.save_checkpoint(make_checkpoint(2, 1), newer_url)
    wait_for(lambda: all(pending.future.done() for pending in plugin._pending), 10, "the failed save")
    with contextlib.suppress(ClientError):  # raising the save's failure here would be fine too
        plugin.remove_checkpoint(older_url)
    with contextlib.suppress(ClientError):
        plugin.teardown()
    assert checkpoint_keys(s3_client, bucket) == ["run/step=1.ckpt"], "the last good checkpoint was deleted"
    assert_same_checkpoint(make_plugin("sync").load_checkpoint(older_url), older)
    ledger(s3_server, "removal right after a failed async save", f"{rule.fired} x 500", "older checkpoint kept")


def test_failed_deferred_removal_is_raised_and_deletes_nothing(
    make_plugin: Callable[..., S3CheckpointIO],
    fault_proxy: FaultProxy,
    s3_client: Any,
    bucket: str,
) -> None:
    plugin = make_plugin("async", PERSISTENT)
    older_url = f"s3://{bucket}/run/step=1.ckpt"
    save_and_wait(plugin, make_checkpoint(1, 1), older_url)
    store_capabilities(plugin.s3, bucket, ["conditional_delete"])  # probed before the fault: the removal's own count
    rule = fault_proxy.add_rule(FaultRule(Fault.status(403, "AccessDenied"), method="POST", query="delete"))
    # Two throttled attempts keep the save in flight, so the removal is deferred behind it.
    fault_proxy.add_rule(FaultRule(Fault.slow_down(), method="POST", query_regex=CREATE_UPLOAD_QUERY, times=2))
    plugin.save_checkpoint(make_checkpoint(2, 6), f"s3://{bucket}/run/step=2.ckpt")
    plugin.remove_checkpoint(older_url)
    with pytest.raises(ClientError) as raised:
        plugin.teardown()
    assert error_code(raised.value) == "AccessDenied"
    assert older_url in rendered(raised.value)
    assert rule.fired == 1  # not retried
    assert checkpoint_keys(s3_client, bucket) == ["run/step=1.ckpt", "run/step=2.ckpt"]


# ---- credentials, region, bucket, permissions: one clear error, no retry storm ---------------------------------------


class ScriptedS3:
    """An HTTP server on 127.0.0.1 that answers every request with one scripted response (status, headers, XML body),
    for answers the fault proxy cannot make: S3's wrong-region errors carry a ``Region``/``Endpoint`` element and an
    ``x-amz-bucket-region`` header, and a redirecting front end sends a bare 301. Records ``(method, path)``."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        self.status, self.headers, self.body = 500, {}, b""
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                owner.requests.append((self.command, self.path))
                self.send_response(owner.status)
                for name, value in owner.headers.items():
                    self.send_header(name, value)
                body = b"" if self.command == "HEAD" else owner.body
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="scripted-s3", daemon=True
        )
        self._thread.start()
        self.endpoint_url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def answer(self, status: int, headers: dict[str, str], code: str = "", message: str = "", extra: str = "") -> None:
        self.status, self.headers = status, headers
        self.body = (
            (
                '<?xml version="1.0" encoding="UTF-8"?>\n'
                f"<Error><Code>{code}</Code><Message>{message}</Message>{extra}"
                "<RequestId>4442587FB7D0A2F9</RequestId><HostId>scripted</HostId></Error>"
            ).encode()
            if code
            else b""
        )

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def scripted_s3() -> Iterator[ScriptedS3]:
    server = ScriptedS3()
    yield server
    server.close()


XML = {"Content-Type": "application/xml"}
ANSWERS: dict[str, tuple[int, dict[str, str], str, str, str]] = {
    "expired-token": (400, XML, "ExpiredToken", "The provided token has expired.", ""),
    "invalid-access-key": (
        403,
        XML,
        "InvalidAccessKeyId",
        "The AWS Access Key Id you provided does not exist in our records.",
        "",
    ),
    "access-denied": (403, XML, "AccessDenied", "Access Denied", ""),
    "wrong-region-301": (
        301,
        {**XML, "x-amz-bucket-region": "eu-west-1"},
        "PermanentRedirect",
        "The bucket you are attempting to access must be addressed using the specified endpoint. "
        "Please send all future requests to this endpoint.",
        "<Endpoint>bucket.s3.eu-west-1.amazonaws.com</Endpoint><Bucket>bucket</Bucket>",
    ),
    "wrong-region-400": (
        400,
        {**XML, "x-amz-bucket-region": "eu-west-1"},
        "AuthorizationHeaderMalformed",
        "The authorization header is malformed; the region 'us-east-1' is wrong; expecting 'eu-west-1'",
        "<Region>eu-west-1</Region>",
    ),
    # A front end that redirects (e.g. http -> https) answers 301 without naming a region.
    "bare-301-redirect": (301, {"Location": "https://s3.example.invalid/"}, "", "", ""),
}
HINTS = {
    "expired-token": r"credentials",
    "invalid-access-key": r"credentials",
    "access-denied": r"credentials|policy|permission",
    "wrong-region-301": r"region",
    "wrong-region-400": r"region",
    "bare-301-redirect": r"region|endpoint|redirect",
}


def _auth_case(name: str, operation: str, *marks: Any) -> Any:
    return pytest.param(name, operation, marks=marks, id=f"{name}-{operation}")


@pytest.mark.parametrize(
    ("case", "operation"),
    [
        _auth_case("expired-token", "save"),
        _auth_case("expired-token", "load"),
        _auth_case("invalid-access-key", "save"),
        _auth_case("invalid-access-key", "load"),
        _auth_case("access-denied", "save"),
        _auth_case("access-denied", "load"),
        _auth_case("wrong-region-301", "save"),
        _auth_case("wrong-region-301", "load"),
        _auth_case("wrong-region-400", "save"),
        _auth_case("wrong-region-400", "load"),
        _auth_case("bare-301-redirect", "save"),
        _auth_case("bare-301-redirect", "load"),
    ],
)
def test_auth_and_region_errors_fail_once_and_clearly(
    case: str, operation: str, scripted_s3: ScriptedS3, s3_server: S3Endpoint
) -> None:
    """One request (two where botocore re-signs once for the region S3 names), no retries, the URL and what to do."""
    scripted_s3.answer(*ANSWERS[case])
    settings = S3ClientSettings(endpoint_url=scripted_s3.endpoint_url, user_agent_extra=f"auth-{uuid.uuid4().hex[:8]}")
    plugin = S3CheckpointIO("s3://bucket/run", chunk_size_MB=5, client_settings=settings, retry_policy=FAST)
    url = "s3://bucket/run/model.ckpt"
    assert plugin.s3.client is not None  # built untimed: a process's first client loads botocore's models
    started = time.monotonic()
    with pytest.raises(Exception) as raised:
        if operation == "save":
            plugin.save_checkpoint(make_checkpoint(1, 0.01), url)  # one PutObject
        else:
            plugin.load_checkpoint(url)
    elapsed = time.monotonic() - started
    message = rendered(raised.value)
    assert 1 <= len(scripted_s3.requests) <= 2, scripted_s3.requests[:5]
    assert plugin.s3.retries == 0
    assert elapsed < 5
    assert url in message
    assert re.search(HINTS[case], message, re.IGNORECASE), message
    ledger(
        s3_server,
        f"{case} on {operation}",
        f"{ANSWERS[case][0]} {ANSWERS[case][2] or 'redirect'}",
        f"{type(raised.value).__name__} after {len(scripted_s3.requests)} request(s), {elapsed:.2f} s",
    )


@pytest.mark.parametrize("operation", ["save", "load"])
def test_missing_credentials_fail_fast_without_a_request(
    operation: str, fault_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch, tmp_path: Any, s3_server: S3Endpoint
) -> None:
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    settings = S3ClientSettings(
        endpoint_url=fault_proxy.endpoint_url, region_name="us-east-1", user_agent_extra=f"nocreds-{uuid.uuid4().hex}"
    )
    plugin = S3CheckpointIO("s3://bucket/run", chunk_size_MB=5, client_settings=settings, retry_policy=FAST)
    url = "s3://bucket/run/model.ckpt"
    assert plugin.s3.client is not None  # built untimed: a process's first client loads botocore's models
    started = time.monotonic()
    with pytest.raises(NoCredentialsError) as raised:
        if operation == "save":
            plugin.save_checkpoint(make_checkpoint(1, 0.01), url)
        else:
            plugin.load_checkpoint(url)
    elapsed = time.monotonic() - started
    assert elapsed < 5
    assert fault_proxy.requests == []
    assert plugin.s3.retries == 0
    assert url in rendered(raised.value) and "credentials" in rendered(raised.value)
    ledger(
        s3_server,
        f"no credentials on {operation}",
        "no keys, no config, no IMDS",
        f"NoCredentialsError, 0 requests, {elapsed:.2f} s",
    )


@pytest.mark.parametrize("operation", ["save", "load"])
def test_missing_bucket_is_one_file_not_found_error(
    operation: str, make_plugin: Callable[..., S3CheckpointIO], fault_proxy: FaultProxy, s3_client: Any,
    s3_server: S3Endpoint,
) -> None:  # fmt: skip
    plugin = make_plugin("sync", FAST)
    missing = f"missing-{uuid.uuid4().hex[:12]}"
    url = f"s3://{missing}/run/model.ckpt"
    checkpoint = make_checkpoint(1, 0.01)
    try:
        try:
            if operation == "save":
                plugin.save_checkpoint(checkpoint, url)
            else:
                plugin.load_checkpoint(url)
        finally:
            requests = len(fault_proxy.requests)
    except FileNotFoundError as exc:
        assert url in rendered(exc)
        if operation == "save":
            assert "bucket" in rendered(exc)
        outcome = "FileNotFoundError, 1 request"
    else:
        # SeaweedFS creates a missing bucket on the first PUT: then the save simply worked, and nothing is lost.
        assert operation == "save" and s3_server.name == "seaweedfs"
        assert_same_checkpoint(plugin.load_checkpoint(url), checkpoint)
        plugin.s3.remove_objects_with_prefix(f"s3://{missing}")
        s3_client.delete_bucket(Bucket=missing)
        outcome = "the store created the bucket; save OK"
    assert requests == 1
    assert plugin.s3.retries == 0
    ledger(s3_server, f"missing bucket on {operation}", "none (real NoSuchBucket)", outcome)
