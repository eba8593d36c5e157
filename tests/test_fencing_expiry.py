"""Expiring fenced requests: a stale run's commit or removal that reaches the store after a newer run's takeover is
refused by the store, even where the ETag condition it carries still holds (its own last commit, an older checkpoint).

A stale run is stopped after its request was signed and before it is sent (botocore's ``before-send`` event, the
last moment in this process) while a newer run takes the directory over; the store (SeaweedFS here; moto checks no
signature) then refuses the request as expired, and the check made again refuses the stale run. The probe says which
store honours it; the signer is pinned against botocore's by the request it sends.
"""

from __future__ import annotations

import datetime
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from s3_servers import S3Endpoint

import s3_checkpoint_cli
import s3_fencing
from s3_checkpoint_io import S3CheckpointIO
from s3_fencing import CheckpointDirectoryTakenError, CheckpointRun, DirectoryFence, current_run
from s3_utils import RetryPolicy, S3Utils, store_capabilities

QUICK = RetryPolicy(max_attempts=4, max_elapsed_s=20, initial_backoff_s=0.01, max_backoff_s=0.05)


def run_at(offset_s: float) -> CheckpointRun:
    return CheckpointRun(uuid.uuid4().hex[:16], "test-host", 1, current_run().started + offset_s)


def plugin_of(run: CheckpointRun) -> S3CheckpointIO:
    plugin = S3CheckpointIO(chunk_size_MB=5, retry_policy=QUICK)
    plugin._run = run
    return plugin


def state(step: int) -> dict[str, Any]:
    return {"step": step, "w": torch.full((64,), float(step))}


def honoured_or_skip(s3_server: S3Endpoint, bucket: str) -> None:
    if not s3_fencing.probe_expiring_requests(S3Utils(), bucket):
        assert s3_server.name == "moto", f"{s3_server.name} should refuse an expired request"
        pytest.skip("moto checks no signature, so it takes an expired request (SeaweedFS and S3 refuse it)")


@pytest.fixture
def on_send() -> Iterator[Callable[[Any, Callable[..., None]], None]]:
    """Register a ``before-send.s3`` handler on a client for the test (the clients are shared by the process)."""
    registered: list[tuple[Any, str]] = []

    def register(client: Any, handler: Callable[..., None]) -> None:
        unique = f"test-on-send-{uuid.uuid4().hex}"
        client.meta.events.register("before-send.s3", handler, unique_id=unique)
        registered.append((client, unique))

    yield register
    for client, unique in registered:
        client.meta.events.unregister("before-send.s3", unique_id=unique)


def stop_before_sending(on_send: Any, client: Any, method: str, key: str, meanwhile: Any) -> list[str]:
    """Run `meanwhile()` once, when `client` is about to send its first `method` request for `key` (in its URL's path
    or its body: DeleteObjects), signed and not sent yet; the list gets the URL it held."""
    held: list[str] = []

    def hold(request: Any, **_: Any) -> None:
        path = urllib.parse.unquote(urllib.parse.urlsplit(request.url).path)
        body = request.body if isinstance(request.body, bytes) else b""
        if not held and request.method == method and (path.endswith("/" + key) or key.encode() in body):
            held.append(request.url)
            meanwhile()

    on_send(client, hold)
    return held


def test_the_probe_finds_which_stores_refuse_an_expired_request(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """SeaweedFS refuses a request signed ten minutes ago with a one-second lifetime and takes one signed now; moto
    takes both (it checks no signature). `doctor` shows it; the probe leaves nothing behind."""
    utils = S3Utils()
    found = s3_fencing.probe_expiring_requests(utils, bucket, "probe-here/")
    assert found is (s3_server.name == "seaweedfs")
    assert store_capabilities(utils, bucket).expiring_requests is found
    assert s3_client.list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    assert s3_checkpoint_cli.main(["doctor", f"s3://{bucket}/x"]) == 0
    assert f"expiring_requests: {'yes' if found else 'no'}" in capsys.readouterr().out


def test_the_signer_dates_a_fenced_request_at_its_check_and_sends_its_body_and_headers(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, on_send: Any
) -> None:
    """What botocore sends inside the fence's signing: SigV4 in the query, dated at the given time, with the
    lifetime, the condition and metadata headers signed, and the body as given (pins botocore's query signer, its
    ``choose-signer`` event and ``_modify_request_before_signing``, which `s3_fencing` builds on)."""
    utils = S3Utils()
    sent: list[Any] = []
    on_send(utils.client, lambda request, **_: sent.append(request) if request.method == "PUT" else None)
    s3_fencing._install_expiring_signer(utils.client)
    moment = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    with s3_fencing._signed_at(moment, 7):
        utils.client.put_object(
            Bucket=bucket, Key="signed", Body=b"body bytes", IfNoneMatch="*", Metadata={"s3ckpt-run": "r"}
        )
    utils.client.put_object(Bucket=bucket, Key="plain", Body=b"plain")  # outside: signed as before
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(sent[0].url).query)
    assert query["X-Amz-Date"] == [moment.strftime("%Y%m%dT%H%M%SZ")] and query["X-Amz-Expires"] == ["7"]
    assert {"if-none-match", "x-amz-meta-s3ckpt-run", "host"} <= set(query["X-Amz-SignedHeaders"][0].split(";"))
    assert "Authorization" not in sent[0].headers and "Authorization" in sent[1].headers
    assert "X-Amz-Date" not in urllib.parse.urlsplit(sent[1].url).query
    assert s3_client.get_object(Bucket=bucket, Key="signed")["Body"].read() == b"body bytes"


def test_a_stale_commit_over_its_own_checkpoint_that_reaches_the_store_after_a_takeover_is_refused(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, on_send: Any
) -> None:
    """The stale run's commit of last.ckpt carries If-Match on its own object, which the newer run has not written
    (it saved another name): the condition holds, but the request, signed at the stale run's check, has expired by
    the time it arrives (the takeover waited its lifetime). The store refuses it; the check made again refuses the
    stale run; last.ckpt stays the checkpoint the newer run resumed from."""
    honoured_or_skip(s3_server, bucket)
    older, newer = run_at(-60), run_at(0)
    stale, new = plugin_of(older), plugin_of(newer)
    last = f"s3://{bucket}/own/last.ckpt"
    stale.save_checkpoint(state(10), last)
    before = s3_client.head_object(Bucket=bucket, Key="own/last.ckpt")["ETag"]
    newer_saves = lambda: new.save_checkpoint(state(20), f"s3://{bucket}/own/step=20.ckpt")  # noqa: E731
    held = stop_before_sending(on_send, stale.s3.client, "PUT", "own/last.ckpt", newer_saves)
    with pytest.raises(CheckpointDirectoryTakenError) as refused:
        stale.save_checkpoint(state(11), last)
    assert held and newer.run_id in str(refused.value)
    assert "expired" in str(refused.value.__context__).lower()  # the store's answer to the held request
    assert s3_client.head_object(Bucket=bucket, Key="own/last.ckpt")["ETag"] == before
    assert new.load_checkpoint(last)["step"] == 10
    assert new.load_checkpoint(f"s3://{bucket}/own/step=20.ckpt")["step"] == 20


def test_a_stale_removal_of_an_older_checkpoint_that_reaches_the_store_after_a_takeover_is_refused(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, on_send: Any
) -> None:
    """The stale run's top-k clean-up of step=1.ckpt (its own, never rewritten: its ETag condition holds) is held
    after signing while a newer run takes over; the store refuses it as expired and the stale run is refused."""
    honoured_or_skip(s3_server, bucket)
    older, newer = run_at(-60), run_at(0)
    stale, new = plugin_of(older), plugin_of(newer)
    url = f"s3://{bucket}/older/step=1.ckpt"
    stale.save_checkpoint(state(1), url)
    newer_saves = lambda: new.save_checkpoint(state(2), f"s3://{bucket}/older/step=2.ckpt")  # noqa: E731
    held = stop_before_sending(on_send, stale.s3.client, "POST", "older/step=1.ckpt", newer_saves)
    with pytest.raises(CheckpointDirectoryTakenError) as refused:
        stale.remove_checkpoint(url)
    assert held and newer.run_id in str(refused.value)
    assert new.load_checkpoint(url)["step"] == 1


def test_a_stale_commit_that_lands_while_the_takeover_waits_counts_as_before_it(
    s3_server: S3Endpoint, bucket: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch, on_send: Any
) -> None:
    """A stale request sent right after the takeover's record, inside its lifetime, is taken by the store; the newer
    run writes nothing until that lifetime is over, and readers count the stale commit as from before the takeover
    (the record's ``quiet_s``), not as a stale run's object to leave out and remove."""
    honoured_or_skip(s3_server, bucket)
    monkeypatch.setenv("S3CKPT_FENCED_REQUEST_LIFETIME_S", "4")  # room for the held request to land in its lifetime
    older, newer = run_at(-60), run_at(0)
    stale, new = plugin_of(older), plugin_of(newer)
    stale.save_checkpoint(state(1), f"s3://{bucket}/quiet/step=1.ckpt")
    record_key = "quiet/" + s3_fencing.OWNER_RECORD_NAME
    first = s3_client.head_object(Bucket=bucket, Key=record_key)["ETag"]
    newer_saved = threading.Thread(target=new.save_checkpoint, args=(state(3), f"s3://{bucket}/quiet/step=3.ckpt"))

    def takeover_written() -> None:
        newer_saved.start()
        deadline = time.monotonic() + 30
        while s3_client.head_object(Bucket=bucket, Key=record_key)["ETag"] == first:
            assert time.monotonic() < deadline
            time.sleep(0.05)

    held = stop_before_sending(on_send, stale.s3.client, "PUT", "quiet/step=2.ckpt", takeover_written)
    stale.save_checkpoint(state(2), f"s3://{bucket}/quiet/step=2.ckpt")  # lands while the newer run waits
    newer_saved.join(60)
    assert held and not newer_saved.is_alive()
    record = s3_client.head_object(Bucket=bucket, Key=record_key)
    stale_commit = s3_client.head_object(Bucket=bucket, Key="quiet/step=2.ckpt")
    new_commit = s3_client.head_object(Bucket=bucket, Key="quiet/step=3.ckpt")
    assert stale_commit["LastModified"] >= record["LastModified"]  # after the takeover's record, by the store
    assert new_commit["LastModified"] >= record["LastModified"] + datetime.timedelta(seconds=5)  # after the wait
    owner = s3_fencing.directory_owner(S3Utils(), f"s3://{bucket}/quiet")
    assert owner is not None and owner.run == newer
    assert owner.taken == record["LastModified"] + datetime.timedelta(seconds=5)
    listed = S3Utils().list_objects(f"s3://{bucket}/quiet")
    assert s3_fencing.stale_objects(S3Utils(), f"s3://{bucket}/quiet", listed) == []
    assert new.load_checkpoint(f"s3://{bucket}/quiet/step=2.ckpt")["step"] == 2


def test_a_fence_checks_again_before_sending_when_its_check_is_old(
    s3_server: S3Endpoint, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit whose check is older than half the lifetime is checked again first (one HEAD), so an owner's slow
    request is not sent only to be refused as expired."""
    honoured_or_skip(s3_server, bucket)
    fence = DirectoryFence(S3Utils(), f"s3://{bucket}/slow", run_at(0))
    fence.before_mutation(f"s3://{bucket}/slow/a", "save")  # takes the (fresh) directory over: no wait
    heads = []
    check = DirectoryFence.before_mutation
    monkeypatch.setattr(DirectoryFence, "before_mutation", lambda self, *a: heads.append(a) or check(self, *a))
    assert fence.sent(f"s3://{bucket}/slow/a", "save", lambda: "sent") == "sent" and heads == []
    checked = fence._hold.checked
    assert checked is not None
    fence._hold.checked = (checked[0], checked[1] - 60)  # a check made a minute ago
    assert fence.sent(f"s3://{bucket}/slow/a", "save", lambda: "sent") == "sent"
    assert heads == [(f"s3://{bucket}/slow/a", "save")]
