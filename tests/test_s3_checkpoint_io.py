"""S3CheckpointIO against a real S3-compatible server: round trips, atomicity, async safety, local paths."""

from __future__ import annotations

import io
import pathlib
import pickle
import threading
import zipfile
from collections import OrderedDict

import pytest
import torch

import s3_checkpoint_io
import s3_utils
from s3_checkpoint_io import S3CheckpointIO, TransferRecord, snapshot_to_host

MiB = 1024 * 1024
BOTH_BUCKET_KINDS = pytest.mark.parametrize("bucket", ["general_purpose", "directory"], indirect=True)
"""Run a test on a general purpose bucket and on a directory bucket behind the directory-bucket proxy."""


def make_checkpoint(seed: int = 0, mib: float = 1) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "state_dict": OrderedDict(
            weight=torch.randn(int(mib * MiB) // 4, generator=generator), bias=torch.arange(10, dtype=torch.float64)
        ),
        "global_step": 100 + seed,
        "epoch": 2,
        "names": ["a", "b"],
    }


def assert_same_checkpoint(loaded: dict, expected: dict) -> None:
    assert loaded.keys() == expected.keys()
    for name, tensor in expected["state_dict"].items():
        assert torch.equal(loaded["state_dict"][name], tensor), name
    assert loaded["global_step"] == expected["global_step"]
    assert loaded["names"] == expected["names"]


def object_keys(s3_client, bucket: str) -> list[str]:
    return sorted(
        o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket).get("Contents", []) if "s3ckpt" not in o["Key"]
    )


def open_uploads(s3_client, bucket: str) -> list[str]:
    return [u["Key"] for u in s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


@pytest.fixture
def plugin(bucket: str):
    io = S3CheckpointIO(f"s3://{bucket}/ckpts", chunk_size_MB=5, max_write_concurrency=3, max_read_concurrency=4)
    yield io
    io.teardown()


@pytest.fixture
def async_plugin(bucket: str):
    io = S3CheckpointIO(f"s3://{bucket}/ckpts", chunk_size_MB=5, max_write_concurrency=3, async_checkpointing=True)
    yield io
    io.teardown()


@BOTH_BUCKET_KINDS
class TestRoundTrip:
    @pytest.mark.parametrize("mib", [0.01, 12.3])  # a single PUT and a multipart upload
    def test_sync_save_then_load(self, plugin: S3CheckpointIO, bucket: str, mib: float) -> None:
        checkpoint = make_checkpoint(mib=mib)
        url = f"s3://{bucket}/ckpts/model.ckpt"
        plugin.save_checkpoint(checkpoint, url)
        assert_same_checkpoint(plugin.load_checkpoint(url), checkpoint)

    def test_async_save_then_load_waits_for_the_upload(self, async_plugin: S3CheckpointIO, bucket: str) -> None:
        checkpoint = make_checkpoint(mib=11)
        url = f"s3://{bucket}/ckpts/model.ckpt"
        async_plugin.save_checkpoint(checkpoint, url)
        assert_same_checkpoint(async_plugin.load_checkpoint(url), checkpoint)

    def test_pathlib_collapsed_url_is_restored(self, plugin: S3CheckpointIO, s3_client, bucket: str) -> None:
        checkpoint = make_checkpoint()
        plugin.save_checkpoint(checkpoint, pathlib.Path(f"s3://{bucket}/ckpts/p.ckpt"))
        assert object_keys(s3_client, bucket) == ["ckpts/p.ckpt"]
        assert_same_checkpoint(plugin.load_checkpoint(pathlib.Path(f"s3://{bucket}/ckpts/p.ckpt")), checkpoint)

    def test_map_location_is_honoured(self, plugin: S3CheckpointIO, bucket: str) -> None:
        url = f"s3://{bucket}/ckpts/m.ckpt"
        plugin.save_checkpoint(make_checkpoint(), url)
        loaded = plugin.load_checkpoint(url, map_location=torch.device("meta"))
        assert loaded["state_dict"]["weight"].device.type == "meta"
        loaded = plugin.load_checkpoint(url, map_location=lambda storage, location: storage)
        assert loaded["state_dict"]["weight"].device.type == "cpu"

    def test_weights_only_follows_torch(self, plugin: S3CheckpointIO, bucket: str) -> None:
        url = f"s3://{bucket}/ckpts/w.ckpt"
        plugin.save_checkpoint({"state_dict": {}, "custom": pathlib.PurePosixPath("x")}, url)
        with pytest.raises(Exception, match=r"[Ww]eights only load failed"):
            plugin.load_checkpoint(url)  # torch's safe default
        with pytest.raises(Exception, match=r"[Ww]eights only load failed"):
            plugin.load_checkpoint(url, weights_only=True)
        assert plugin.load_checkpoint(url, weights_only=False)["custom"] == pathlib.PurePosixPath("x")

    def test_newer_lightning_state_keyword_is_accepted(self, plugin: S3CheckpointIO, bucket: str) -> None:
        url = f"s3://{bucket}/ckpts/s.ckpt"
        plugin.save_checkpoint(make_checkpoint(), url)
        assert plugin.load_checkpoint(url, state={}, weights_only=True)["global_step"] == 100
        with pytest.raises(TypeError, match="unexpected"):
            plugin.load_checkpoint(url, bogus=1)

    def test_missing_checkpoint_is_file_not_found(self, plugin: S3CheckpointIO, bucket: str) -> None:
        url = f"s3://{bucket}/ckpts/absent.ckpt"
        with pytest.raises(FileNotFoundError, match=url):
            plugin.load_checkpoint(url)

    def test_storage_options_are_rejected_like_torch_checkpoint_io(self, plugin: S3CheckpointIO, bucket) -> None:
        with pytest.raises(TypeError, match="storage_options"):
            plugin.save_checkpoint({}, f"s3://{bucket}/x.ckpt", storage_options={"a": 1})

    def test_no_process_group_needed(self, plugin: S3CheckpointIO, bucket: str) -> None:
        assert not torch.distributed.is_initialized()
        plugin.save_checkpoint(make_checkpoint(), f"s3://{bucket}/ckpts/solo.ckpt")
        plugin.remove_checkpoint(f"s3://{bucket}/ckpts/solo.ckpt")
        plugin.teardown()


class _BorrowSpy:
    """Counts the parts S3MultipartWriter.write_borrowed sends straight from the caller's memory, and whose memory."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.parts = 0
        self.owners: list[object] = []
        real, send_borrowed = s3_utils.S3MultipartWriter.write_borrowed, s3_utils.S3MultipartWriter._send_borrowed_part
        spy = self

        def write_borrowed(writer: s3_utils.S3MultipartWriter, data: object, owner: object) -> int:
            written = real(writer, data, owner)
            spy.owners.append(owner)
            return written

        def send_borrowed_part(writer: s3_utils.S3MultipartWriter, *args: object, **kwargs: object) -> None:
            send_borrowed(writer, *args, **kwargs)
            spy.parts += 1

        monkeypatch.setattr(s3_utils.S3MultipartWriter, "write_borrowed", write_borrowed)
        monkeypatch.setattr(s3_utils.S3MultipartWriter, "_send_borrowed_part", send_borrowed_part)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_checkpoints_own_cpu_tensors_are_uploaded_without_a_copy(
    mode: str, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """Whole parts of a large CPU tensor go to the store straight from its memory (the original's in a sync save,
    the snapshot's in an async one), once for a storage two tensors share; torch.load reads the object."""
    spy = _BorrowSpy(monkeypatch)
    checkpoint = make_checkpoint(mib=23)
    checkpoint["state_dict"]["row"] = checkpoint["state_dict"]["weight"][:7]  # a view of the same storage
    plugin = S3CheckpointIO(f"s3://{bucket}/held", chunk_size_MB=5, async_checkpointing=mode == "async")
    try:
        url = f"s3://{bucket}/held/model.ckpt"
        plugin.save_checkpoint(checkpoint, url)
        plugin.wait_for_pending_saves()
        loaded = plugin.load_checkpoint(url)
    finally:
        plugin.teardown()
    assert spy.parts >= 3 and len(spy.owners) == 1  # the 23 MiB storage, once (the view shares it)
    weight = checkpoint["state_dict"]["weight"]
    owns_original = spy.owners[0].data_ptr() == weight.untyped_storage().data_ptr()
    assert owns_original == (mode == "sync")
    assert_same_checkpoint(loaded, checkpoint)
    local = tmp_path / "model.ckpt"
    s3_utils.S3Utils().download_s3_file_to_path(url, local)
    assert_same_checkpoint(torch.load(local, weights_only=True), checkpoint)


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


@BOTH_BUCKET_KINDS
class TestAtomicity:
    def test_failed_save_leaves_no_object_and_keeps_the_older_one(
        self, plugin: S3CheckpointIO, s3_client, bucket: str
    ) -> None:
        url = f"s3://{bucket}/ckpts/model.ckpt"
        older = make_checkpoint(seed=1)
        plugin.save_checkpoint(older, url)
        # Large tensors are written (several parts uploaded) before pickling reaches the bad object.
        broken = {"big": torch.randn(12 * MiB // 4), "z": _Unpicklable()}
        with pytest.raises(RuntimeError, match="cannot pickle"):
            plugin.save_checkpoint(broken, url)
        assert open_uploads(s3_client, bucket) == []
        assert_same_checkpoint(plugin.load_checkpoint(url), older)

    def test_failed_first_save_leaves_nothing_visible(self, plugin: S3CheckpointIO, s3_client, bucket: str) -> None:
        with pytest.raises(RuntimeError, match="cannot pickle"):
            plugin.save_checkpoint({"big": torch.randn(12 * MiB // 4), "z": _Unpicklable()}, f"s3://{bucket}/n.ckpt")
        assert object_keys(s3_client, bucket) == []
        assert open_uploads(s3_client, bucket) == []

    def test_conflicting_last_checkpoints_removed_after_the_new_one_is_durable(
        self, plugin: S3CheckpointIO, s3_client, bucket: str
    ) -> None:
        base = f"s3://{bucket}/ckpts/megatron_gpt--val_loss=1.00-step=5-consumed_samples=10"
        plugin.save_checkpoint(make_checkpoint(), f"{base}.0-last.ckpt")
        plugin.save_checkpoint(make_checkpoint(), f"s3://{bucket}/ckpts/megatron_gpt--val_loss=1.00-step=50-last.ckpt")
        plugin.save_checkpoint(make_checkpoint(), f"{base}.5-last.ckpt")
        assert object_keys(s3_client, bucket) == [
            "ckpts/megatron_gpt--val_loss=1.00-step=5-consumed_samples=10.5-last.ckpt",
            "ckpts/megatron_gpt--val_loss=1.00-step=50-last.ckpt",
        ]

    def test_conflicting_last_is_kept_when_the_new_save_fails(
        self, plugin: S3CheckpointIO, s3_client, bucket: str
    ) -> None:
        base = f"s3://{bucket}/ckpts/m--step=5-"
        plugin.save_checkpoint(make_checkpoint(), f"{base}a-last.ckpt")
        with pytest.raises(RuntimeError, match="cannot pickle"):
            plugin.save_checkpoint({"z": _Unpicklable()}, f"{base}b-last.ckpt")
        assert object_keys(s3_client, bucket) == ["ckpts/m--step=5-a-last.ckpt"]


@BOTH_BUCKET_KINDS
def test_async_last_save_removes_the_conflicting_last_checkpoint(
    async_plugin: S3CheckpointIO, s3_client, bucket: str
) -> None:
    base = f"s3://{bucket}/ckpts/m--step=7-"
    async_plugin.save_checkpoint(make_checkpoint(1), f"{base}a-last.ckpt")
    async_plugin.save_checkpoint(make_checkpoint(2), f"{base}b-last.ckpt")
    async_plugin.save_checkpoint(make_checkpoint(3), f"s3://{bucket}/ckpts/m--step=70-last.ckpt")
    async_plugin.teardown()  # waits for the background saves
    assert object_keys(s3_client, bucket) == ["ckpts/m--step=7-b-last.ckpt", "ckpts/m--step=70-last.ckpt"]
    assert_same_checkpoint(async_plugin.load_checkpoint(f"{base}b-last.ckpt"), make_checkpoint(2))


class _GatedSaves:
    """Holds background saves (those of paths ending in `only`, if given) until released, optionally failing them, to
    observe what happens meanwhile."""

    def __init__(self, plugin: S3CheckpointIO, fail: bool = False, only: str | None = None) -> None:
        self.release = threading.Event()
        self.fail = fail
        self.only = only
        self._save_now = plugin._save_now
        plugin._save_now = self  # type: ignore[method-assign]

    def __call__(self, checkpoint: dict, path: str) -> TransferRecord:
        if self.only is not None and not path.endswith(self.only):
            return self._save_now(checkpoint, path)
        assert self.release.wait(30), "test never released the gate"
        if self.fail:
            raise ConnectionResetError(f"injected failure while uploading {path}")
        return self._save_now(checkpoint, path)


@BOTH_BUCKET_KINDS
class TestAsyncSafety:
    def test_snapshot_is_taken_before_save_returns(self, async_plugin: S3CheckpointIO, bucket: str) -> None:
        gate = _GatedSaves(async_plugin)
        checkpoint = make_checkpoint()
        expected = {name: tensor.clone() for name, tensor in checkpoint["state_dict"].items()}
        url = f"s3://{bucket}/ckpts/snap.ckpt"
        async_plugin.save_checkpoint(checkpoint, url)
        checkpoint["state_dict"]["weight"].add_(1.0)  # training mutates the tensors in place right away
        checkpoint["state_dict"]["new"] = torch.zeros(1)
        gate.release.set()
        loaded = async_plugin.load_checkpoint(url)
        assert torch.equal(loaded["state_dict"]["weight"], expected["weight"])
        assert "new" not in loaded["state_dict"]

    def test_removal_waits_until_the_newer_save_is_durable(
        self, async_plugin: S3CheckpointIO, s3_client, bucket: str
    ) -> None:
        old, new = f"s3://{bucket}/ckpts/old.ckpt", f"s3://{bucket}/ckpts/new.ckpt"
        async_plugin.save_checkpoint(make_checkpoint(), old)
        async_plugin.wait_for_pending_saves()
        gate = _GatedSaves(async_plugin)
        async_plugin.save_checkpoint(make_checkpoint(seed=2), new)
        async_plugin.remove_checkpoint(old)  # what ModelCheckpoint does right after saving the newer one
        assert object_keys(s3_client, bucket) == ["ckpts/old.ckpt"]
        gate.release.set()
        async_plugin.teardown()
        assert object_keys(s3_client, bucket) == ["ckpts/new.ckpt"]

    def test_failed_save_keeps_the_older_checkpoint_and_is_raised(
        self, async_plugin: S3CheckpointIO, s3_client, bucket: str
    ) -> None:
        old, new = f"s3://{bucket}/ckpts/old.ckpt", f"s3://{bucket}/ckpts/new.ckpt"
        older = make_checkpoint(seed=3)
        async_plugin.save_checkpoint(older, old)
        async_plugin.wait_for_pending_saves()
        gate = _GatedSaves(async_plugin, fail=True)
        async_plugin.save_checkpoint(make_checkpoint(), new)
        async_plugin.remove_checkpoint(old)
        gate.release.set()
        with pytest.raises(ConnectionResetError, match="injected failure"):
            async_plugin.teardown()
        assert object_keys(s3_client, bucket) == ["ckpts/old.ckpt"]
        assert_same_checkpoint(async_plugin.load_checkpoint(old), older)

    @pytest.mark.parametrize("next_call", ["save", "load", "remove"])
    def test_background_failure_surfaces_at_the_next_call(
        self, async_plugin: S3CheckpointIO, bucket: str, next_call: str
    ) -> None:
        gate = _GatedSaves(async_plugin, fail=True)
        gate.release.set()
        async_plugin.save_checkpoint(make_checkpoint(), f"s3://{bucket}/ckpts/a.ckpt")
        while async_plugin._pending:
            async_plugin._pending[0].settled.wait()
        calls = {
            "save": lambda: async_plugin.save_checkpoint(make_checkpoint(), f"s3://{bucket}/ckpts/b.ckpt"),
            "load": lambda: async_plugin.load_checkpoint(f"s3://{bucket}/ckpts/a.ckpt"),
            "remove": lambda: async_plugin.remove_checkpoint(f"s3://{bucket}/ckpts/a.ckpt"),
        }
        with pytest.raises(ConnectionResetError, match="injected failure"):
            calls[next_call]()
        async_plugin.teardown()  # reported once, not again

    def test_saves_in_flight_are_bounded(self, bucket: str) -> None:
        plugin = S3CheckpointIO(f"s3://{bucket}/c", chunk_size_MB=5, async_checkpointing=True, max_saves_in_flight=2)
        gate = _GatedSaves(plugin)
        plugin.save_checkpoint(make_checkpoint(), f"s3://{bucket}/c/1.ckpt")
        plugin.save_checkpoint(make_checkpoint(), f"s3://{bucket}/c/2.ckpt")
        third = threading.Thread(target=plugin.save_checkpoint, args=(make_checkpoint(), f"s3://{bucket}/c/3.ckpt"))
        third.start()
        third.join(0.5)
        assert third.is_alive(), "a third save must wait while two are in flight"
        gate.release.set()
        third.join(30)
        assert not third.is_alive()
        plugin.teardown()
        assert sorted(o.key for o in plugin.s3.list_objects(f"s3://{bucket}/c")) == ["c/1.ckpt", "c/2.ckpt", "c/3.ckpt"]


def test_snapshot_copies_tensors_and_containers() -> None:
    tensor = torch.ones(3)
    original = {"a": OrderedDict(t=tensor), "b": [tensor, (tensor, 1)], "c": "text"}
    copy = snapshot_to_host(original)
    tensor.add_(1)
    assert torch.equal(copy["a"]["t"], torch.ones(3))
    assert type(copy["a"]) is OrderedDict
    assert torch.equal(copy["b"][1][0], torch.ones(3))
    assert copy["c"] == "text"


def test_async_save_of_odd_tensors_round_trips(async_plugin: S3CheckpointIO, bucket: str) -> None:
    """Odd byte counts, a transposed (non-contiguous) tensor and a view into a larger storage, across 5 MiB parts:
    what the background save wrote (lent, borrowed and copied bytes) loads back equal."""
    generator = torch.Generator().manual_seed(7)
    base = torch.randn(700, 1001, generator=generator)
    checkpoint = {
        "state_dict": OrderedDict(
            odd=torch.randint(0, 256, (5 * MiB + 3,), dtype=torch.uint8, generator=generator),
            transposed=base.t(),
            view=base[100:400],
            small=torch.arange(7, dtype=torch.int16),
        ),
        "global_step": 3,
    }
    url = f"s3://{bucket}/ckpts/odd.ckpt"
    async_plugin.save_checkpoint(checkpoint, url)
    async_plugin.wait_for_pending_saves()
    loaded = async_plugin.load_checkpoint(url)
    for name, tensor in checkpoint["state_dict"].items():
        assert torch.equal(loaded["state_dict"][name], tensor), name
    assert loaded["global_step"] == 3


class TestLocalPaths:
    def test_local_save_load_remove(self, tmp_path: pathlib.Path) -> None:
        plugin = S3CheckpointIO(tmp_path)
        path = tmp_path / "nested" / "model.ckpt"
        checkpoint = make_checkpoint()
        plugin.save_checkpoint(checkpoint, path)
        assert [p.name for p in path.parent.iterdir()] == ["model.ckpt"]  # no temporary file left
        assert_same_checkpoint(plugin.load_checkpoint(path), checkpoint)
        plugin.remove_checkpoint(path)
        assert not path.exists()

    def test_local_remove_of_a_directory_checkpoint(self, tmp_path: pathlib.Path) -> None:
        directory = tmp_path / "dist.ckpt"
        (directory / "shard").mkdir(parents=True)
        (directory / "shard" / "0.distcp").write_bytes(b"x")
        S3CheckpointIO(tmp_path).remove_checkpoint(directory)
        assert not directory.exists()

    def test_local_missing_file(self, tmp_path: pathlib.Path) -> None:
        with pytest.raises(FileNotFoundError, match=r"absent\.ckpt"):
            S3CheckpointIO(tmp_path).load_checkpoint(tmp_path / "absent.ckpt")


def test_plugin_pickles_for_spawn_launchers(bucket: str) -> None:
    plugin = S3CheckpointIO(f"s3://{bucket}/c", chunk_size_MB=5, async_checkpointing=True)
    copy = pickle.loads(pickle.dumps(plugin))
    assert copy.async_checkpointing and copy.chunk_size_MB == 5
    assert copy.s3.settings == plugin.s3.settings and copy.s3.retry_policy == plugin.s3.retry_policy
    copy.save_checkpoint(make_checkpoint(), f"s3://{bucket}/c/0.ckpt")  # the copy works on its own
    copy.teardown()
    gate = _GatedSaves(plugin)
    plugin.save_checkpoint(make_checkpoint(), f"s3://{bucket}/c/1.ckpt")
    with pytest.raises(RuntimeError, match="pending"):
        pickle.dumps(plugin)
    gate.release.set()
    plugin.teardown()


# ---- torch's zip CRC32: skipped for S3 saves (the object's own checksum covers every byte), only there ---------------


def test_s3_saves_skip_the_zip_crc32_and_still_load_in_torchs_own_readers(
    plugin: S3CheckpointIO, bucket: str, tmp_path: pathlib.Path
) -> None:
    """The object's records carry no zip CRC32 (the pass torch.save spends a quarter of a save's CPU on), and
    torch.load reads it as it is: plain, mmap'd and weights_only. Other threads' torch.save keep their CRCs."""
    checkpoint = make_checkpoint(seed=5, mib=6)
    others: list[bytes] = []
    stop = threading.Event()

    def save_elsewhere() -> None:  # another thread's torch.save, running while ours does
        while not stop.is_set():
            buffer = io.BytesIO()
            torch.save({"x": torch.arange(100_000)}, buffer)
            others.append(buffer.getvalue())

    thread = threading.Thread(target=save_elsewhere)
    thread.start()
    try:
        plugin.save_checkpoint(checkpoint, f"s3://{bucket}/no-crc.ckpt")
    finally:
        stop.set()
        thread.join()
    path = tmp_path / "copy.ckpt"
    plugin.s3.download_s3_file_to_path(f"s3://{bucket}/no-crc.ckpt", str(path))  # verified against its CRC32C
    with zipfile.ZipFile(path) as archive:
        assert {record.CRC for record in archive.infolist()} == {0}
    for kwargs in ({}, {"mmap": True}, {"mmap": True, "weights_only": True}):
        assert_same_checkpoint(torch.load(path, **kwargs), checkpoint)
    assert_same_checkpoint(plugin.load_checkpoint(f"s3://{bucket}/no-crc.ckpt"), checkpoint)
    assert torch.serialization.get_crc32_options() is True  # the process-wide flag was never touched
    assert others
    for data in others:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            assert archive.testzip() is None  # every record's CRC is there and right


def test_local_saves_keep_the_zip_crc32(plugin: S3CheckpointIO, tmp_path: pathlib.Path) -> None:
    path = tmp_path / "local.ckpt"
    plugin.save_checkpoint(make_checkpoint(), str(path))
    with zipfile.ZipFile(path) as archive:  # nothing of ours checks a local file: torch's CRC stays
        assert archive.testzip() is None


# --------------------------------------------------------------------------------------------------------------------
# Lightning's conventions: a load waits for this process's pending save of its URL, Lightning's errors
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("outcome", ["saved", "failed"])
def test_a_load_by_another_instance_waits_for_the_pending_save_of_its_url(
    async_plugin: S3CheckpointIO, bucket: str, outcome: str
) -> None:
    """A new Trainer (a new plugin) loading what ``trainer.save_checkpoint`` queued after ``fit`` got 'No such
    object': the load now waits for the save in flight in this process, or raises its failure."""
    url = f"s3://{bucket}/ckpts/after-fit.ckpt"
    gate = _GatedSaves(async_plugin, fail=outcome == "failed")
    async_plugin.save_checkpoint(make_checkpoint(seed=5), url)
    assert s3_checkpoint_io.pending_operation(url) == "save"
    reader = S3CheckpointIO(f"s3://{bucket}/ckpts", chunk_size_MB=5)  # another instance, sync
    result: dict[str, object] = {}

    def load() -> None:
        try:
            result["checkpoint"] = reader.load_checkpoint(url)
        except BaseException as exc:
            result["error"] = exc

    loader = threading.Thread(target=load)
    loader.start()
    loader.join(0.5)
    assert loader.is_alive(), "the load must wait while the save of its URL is in flight"
    gate.release.set()
    loader.join(30)
    assert not loader.is_alive()
    assert s3_checkpoint_io.pending_operation(url) is None
    if outcome == "saved":
        assert_same_checkpoint(result["checkpoint"], make_checkpoint(seed=5))
    else:
        assert isinstance(result.get("error"), ConnectionResetError), result
        with pytest.raises(ConnectionResetError):
            async_plugin.teardown()  # its own plugin reports it too


def test_a_save_supersedes_a_removal_of_its_path_deferred_behind_another_save(s3_client, bucket: str) -> None:
    """Remove X (deferred behind a pending save of Y), then save X again: the removal must not delete the new X."""
    plugin = S3CheckpointIO(f"s3://{bucket}/c", chunk_size_MB=5, async_checkpointing=True, max_saves_in_flight=2)
    old, other = f"s3://{bucket}/ckpts/x.ckpt", f"s3://{bucket}/ckpts/y.ckpt"
    plugin.save_checkpoint(make_checkpoint(seed=1), old)
    plugin.wait_for_pending_saves()
    gate = _GatedSaves(plugin, only="y.ckpt")
    plugin.save_checkpoint(make_checkpoint(seed=2), other)
    plugin.remove_checkpoint(old)
    assert s3_checkpoint_io.pending_operation(old) == "remove"
    gate_x = _GatedSaves(plugin, only="x.ckpt")  # held, so that what is pending for X can be seen (else it may be done)
    plugin.save_checkpoint(make_checkpoint(seed=3), old)
    assert s3_checkpoint_io.pending_operation(old) == "save"
    gate_x.release.set()
    s3_checkpoint_io.wait_for_pending_save(old)  # the new X is durable before Y settles
    gate.release.set()
    plugin.teardown()
    assert object_keys(s3_client, bucket) == ["ckpts/x.ckpt", "ckpts/y.ckpt"]
    assert_same_checkpoint(plugin.load_checkpoint(old), make_checkpoint(seed=3))


def test_a_missing_checkpoint_has_lightnings_wording_and_s3s_detail_as_notes(
    plugin: S3CheckpointIO, bucket: str
) -> None:
    url = f"s3://{bucket}/ckpts/absent.ckpt"
    with pytest.raises(FileNotFoundError) as raised:
        plugin.load_checkpoint(url)
    assert str(raised.value) == f"Checkpoint file not found: {url}"  # Lightning's TorchCheckpointIO's words
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert url in notes and "404" in notes, notes


def test_a_checkpoint_s3_refuses_to_read_is_a_permission_error_with_s3s_detail(
    fault_proxy, s3_client, bucket: str
) -> None:
    from fault_proxy import Fault, FaultRule

    s3_client.put_object(Bucket=bucket, Key="ckpts/locked.ckpt", Body=b"x")
    url = f"s3://{bucket}/ckpts/locked.ckpt"
    plugin = S3CheckpointIO(f"s3://{bucket}/ckpts", chunk_size_MB=5, endpoint_url=fault_proxy.endpoint_url)
    fault_proxy.add_rule(FaultRule(Fault.status(403), method="HEAD"))
    fault_proxy.add_rule(FaultRule(Fault.status(403), method="GET"))
    with pytest.raises(PermissionError, match="Permission denied") as raised:
        plugin.load_checkpoint(url)
    assert raised.value.filename == url
    assert "403" in "\n".join(getattr(raised.value, "__notes__", []))
