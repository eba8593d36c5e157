"""S3-aware ModelCheckpoint, connector and one-call wiring in real single-process Lightning fits against S3.

The multi-process (DDP) behaviour is in test_connector_ddp.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from tiny_lightning import FAMILIES, TOP_K_CHECKPOINT, lightning_family, tiny_module_class, tiny_trainer

import connector
from s3_checkpoint_io import S3CheckpointIO
from s3_utils import fresh_s3fs_instances

BOTH_BUCKET_KINDS = pytest.mark.parametrize("bucket", ["general_purpose", "directory"], indirect=True)
"""Run a test on a general purpose bucket and on a directory bucket behind the directory-bucket proxy."""

pytestmark = pytest.mark.lightning

LAUNCHER_VARIABLES = (
    "RANK",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_RANK",
    "PMI_RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
)


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """These fits are single-process: make sure no launcher variable of the surrounding shell says otherwise."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _fresh_s3fs() -> Iterator[None]:
    """s3fs keeps one filesystem per constructor arguments for the whole process, with the endpoint it read from the
    environment when it was made: drop them so each test (and backend) gets one for its own server."""
    pytest.importorskip("s3fs")
    with fresh_s3fs_instances():
        yield


def make_module(pl):
    return tiny_module_class(pl, optimizer="sgd")()


def objects(s3_client, bucket: str, prefix: str = "") -> dict[str, tuple[str, object]]:
    """key -> (ETag, LastModified) of the checkpoint objects (checksum side files left out)."""
    listing = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"]: (o["ETag"], o["LastModified"]) for o in listing if o["Key"].endswith(".ckpt")}


def nemo_style_config(dirpath: str, **exp_manager) -> dict:
    return {
        "s3_checkpointing": {
            "max_write_concurrency": 4,
            "max_read_concurrency": 4,
            "chunk_size_MB": 5,
            "enable_async_checkpointing": False,
        },
        "exp_manager": {
            "checkpoint_callback_params": {
                **TOP_K_CHECKPOINT,
                "dirpath": dirpath,
                "filename": "tiny--{step}",
                "save_nemo_on_train_end": False,  # NeMoModelCheckpoint-only: ignored with a warning
            },
            **exp_manager,
        },
    }


# --------------------------------------------------------------------------------------------------------------------
# A second run into the same dirpath never overwrites the first one
# --------------------------------------------------------------------------------------------------------------------


@BOTH_BUCKET_KINDS
@pytest.mark.parametrize(
    ("family", "callback"),
    [
        ("lightning.pytorch", "S3ModelCheckpoint"),
        ("pytorch_lightning", "S3ModelCheckpoint"),
        # Lightning's own ModelCheckpoint relies on S3CheckpointIO dropping s3fs's cached listings after each save.
        ("lightning.pytorch", "ModelCheckpoint"),
    ],
)
def test_second_fit_into_the_same_dirpath_writes_v1_names(family: str, callback: str, s3_client, bucket: str) -> None:
    pl = lightning_family(family)
    dirpath = f"s3://{bucket}/run"
    callback_class = (
        connector.s3_model_checkpoint_class(family) if callback == "S3ModelCheckpoint" else pl.callbacks.ModelCheckpoint
    )

    def fit() -> None:
        callback = callback_class(dirpath=dirpath, **TOP_K_CHECKPOINT)
        trainer = tiny_trainer(pl, 4, plugins=[S3CheckpointIO(dirpath, chunk_size_MB=5)], callbacks=[callback])
        trainer.fit(make_module(pl))

    fit()
    first = objects(s3_client, bucket)
    assert sorted(first) == ["run/last.ckpt", "run/tiny-step=2.ckpt", "run/tiny-step=4.ckpt"]
    fit()
    second = objects(s3_client, bucket)
    assert sorted(second) == sorted([*first, "run/last-v1.ckpt", "run/tiny-step=2-v1.ckpt", "run/tiny-step=4-v1.ckpt"])
    for key, version in first.items():
        assert second[key] == version, f"{key} was overwritten by the second run"


def test_existence_checks_ignore_a_stale_s3fs_listing_cache(s3_client, bucket: str) -> None:
    """s3fs caches listings per process: once it has listed the directory, objects written by anyone else stay
    invisible to ``exists()``, and Lightning's ModelCheckpoint would silently overwrite them."""
    import fsspec

    pl = lightning_family("lightning.pytorch")
    dirpath = f"s3://{bucket}/run"
    s3_client.put_object(Bucket=bucket, Key="run/notes.txt", Body=b"x")
    filesystem = fsspec.filesystem("s3")
    filesystem.ls(dirpath)  # this process has now cached the listing of run/
    for name in ("last.ckpt", "tiny-step=2.ckpt", "tiny-step=4.ckpt"):  # another job's checkpoints
        s3_client.put_object(Bucket=bucket, Key=f"run/{name}", Body=b"someone else's checkpoint")
    assert not filesystem.exists(f"{dirpath}/last.ckpt"), "precondition: the s3fs cache is stale"
    before = objects(s3_client, bucket)

    callback = connector.S3ModelCheckpoint(dirpath=dirpath, **TOP_K_CHECKPOINT)
    trainer = tiny_trainer(pl, 4, plugins=[S3CheckpointIO(dirpath, chunk_size_MB=5)], callbacks=[callback])
    trainer.fit(make_module(pl))

    after = objects(s3_client, bucket)
    assert {key: after[key] for key in before} == before, "another job's checkpoints were overwritten"
    assert {"run/last-v1.ckpt", "run/tiny-step=2-v1.ckpt", "run/tiny-step=4-v1.ckpt"} <= set(after)
    assert filesystem.exists(f"{dirpath}/last-v1.ckpt"), "the s3fs view was refreshed after the saves"


# --------------------------------------------------------------------------------------------------------------------
# Resuming: NeMo-style config, check_resume, "last", top-k bookkeeping
# --------------------------------------------------------------------------------------------------------------------


@BOTH_BUCKET_KINDS
@pytest.mark.parametrize("family", FAMILIES)
def test_config_wiring_trains_then_resumes_and_keeps_top_k(family: str, s3_client, bucket: str) -> None:
    pl = lightning_family(family)
    dirpath = f"s3://{bucket}/exp/checkpoints"

    trainer = tiny_trainer(pl, 6)
    first = connector.configure_s3_checkpointing(trainer, nemo_style_config(dirpath, resume_if_exists=False))
    assert trainer.strategy.checkpoint_io is first.checkpoint_io
    assert trainer.checkpoint_callbacks == [first.checkpoint_callback]  # Lightning's default one was replaced
    assert isinstance(trainer._checkpoint_connector, connector.BroadcastResumeConnectorMixin)
    assert first.checkpoint_io.max_write_concurrency == 4 and first.checkpoint_io.chunk_size_MB == 5
    trainer.fit(make_module(pl))
    assert sorted(objects(s3_client, bucket)) == [
        "exp/checkpoints/tiny--step=4.ckpt",
        "exp/checkpoints/tiny--step=6-last.ckpt",  # NeMo's "{filename}-last" naming
        "exp/checkpoints/tiny--step=6.ckpt",
    ]

    resumed = tiny_trainer(pl, 10)
    config = nemo_style_config(dirpath, resume_if_exists=True, resume_ignore_no_checkpoint=False)
    second = connector.configure_s3_checkpointing(resumed, config)
    assert second.resume_path == resumed.ckpt_path == f"{dirpath}/tiny--step=6-last.ckpt"
    module = make_module(pl)
    resumed.fit(module)
    assert module.started_at["global_step"] == 6
    callback = second.checkpoint_callback
    assert set(callback.best_k_models) == {f"{dirpath}/tiny--step=8.ckpt", f"{dirpath}/tiny--step=10.ckpt"}
    # The first run's top-k entries were restored and evicted through S3, not orphaned (NeMo wiped them); the
    # checkpoint the run resumed from is kept (the "last" clean-up would have removed it: Lightning #21813).
    assert sorted(objects(s3_client, bucket)) == [
        "exp/checkpoints/tiny--step=10-last.ckpt",
        "exp/checkpoints/tiny--step=10.ckpt",
        "exp/checkpoints/tiny--step=6-last.ckpt",
        "exp/checkpoints/tiny--step=8.ckpt",
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_resumed_run_keeps_the_checkpoint_it_resumed_from_and_those_outside_its_dirpath(
    family: str, s3_client, bucket: str
) -> None:
    """Lightning keeps both on a local directory (``_should_remove_checkpoint``) but removes any remote path (#21813):
    a resumed run's top-k deleted the checkpoint it resumed from, and with it the only one left if it then failed."""
    pl = lightning_family(family)
    callback_class = connector.s3_model_checkpoint_class(family)
    module_class = tiny_module_class(pl, optimizer="sgd", samples=4)  # 1 step per epoch

    def fit(dirpath: str, epochs: int, ckpt_path: str | None = None, **options) -> None:
        callback = callback_class(dirpath=dirpath, save_top_k=1, **options)
        trainer = tiny_trainer(
            pl, -1, max_epochs=epochs, plugins=[S3CheckpointIO(dirpath, chunk_size_MB=5)], callbacks=[callback]
        )
        trainer.fit(module_class(), ckpt_path=ckpt_path)

    run = f"s3://{bucket}/run"
    fit(run, 2)  # run 1: top-1 keeps the newest
    assert sorted(objects(s3_client, bucket)) == ["run/epoch=1-step=2.ckpt"]
    fit(run, 4, ckpt_path=f"{run}/epoch=1-step=2.ckpt")  # run 2 trains on: its own top-1 still turns over
    assert sorted(objects(s3_client, bucket)) == ["run/epoch=1-step=2.ckpt", "run/epoch=3-step=4.ckpt"]

    # Another dirpath resuming from run/last.ckpt: the restored best model (run/epoch=...) is outside its dirpath.
    fit(run, 5, ckpt_path=f"{run}/epoch=3-step=4.ckpt", save_last=True)
    before = objects(s3_client, bucket, "run/")
    fit(f"s3://{bucket}/other", 6, ckpt_path=f"{run}/last.ckpt")
    assert objects(s3_client, bucket, "run/") == before
    assert sorted(objects(s3_client, bucket, "other/")) == ["other/epoch=5-step=6.ckpt"]

    callback = callback_class(dirpath=run)
    trainer = tiny_trainer(pl, 1, callbacks=[callback])
    trainer.ckpt_path = f"{run}/epoch=1-step=2.ckpt"
    assert callback.kept_from_removal(trainer, f"{run}/epoch=1-step=2.ckpt") == (
        "it is the checkpoint this run resumed from"
    )
    assert "outside" in callback.kept_from_removal(trainer, f"s3://{bucket}/run_old/a.ckpt")
    assert callback.kept_from_removal(trainer, f"{run}/epoch=3-step=4.ckpt") is None


@BOTH_BUCKET_KINDS
@pytest.mark.parametrize("family", FAMILIES)
def test_ckpt_path_last_keeps_the_s3_url(family: str, s3_client, bucket: str) -> None:
    pl = lightning_family(family)
    dirpath = f"s3://{bucket}/run"
    callback_class = connector.s3_model_checkpoint_class(family)

    def trainer_for(max_steps: int):
        callback = callback_class(dirpath=dirpath, save_last=True, every_n_train_steps=2, save_top_k=0)
        trainer = tiny_trainer(pl, max_steps, plugins=[S3CheckpointIO(dirpath, chunk_size_MB=5)], callbacks=[callback])
        connector.install_checkpoint_connector(trainer)
        return trainer

    trainer_for(4).fit(make_module(pl))
    s3_client.put_object(Bucket=bucket, Key="run_old/last.ckpt", Body=b"sibling prefix, not a checkpoint")
    resumed = trainer_for(6)
    module = make_module(pl)
    resumed.fit(module, ckpt_path="last")
    assert module.started_at["global_step"] == 4
    assert resumed.ckpt_path == f"{dirpath}/last.ckpt"  # not "s3:/..." (Lightning #18261)


def test_setup_installs_the_connector_and_broadcast_keeps_state(bucket: str) -> None:
    pl = lightning_family("lightning.pytorch")
    dirpath = f"s3://{bucket}/run/"
    callback = connector.S3ModelCheckpoint(dirpath=dirpath, save_last=True)
    assert callback.dirpath == f"s3://{bucket}/run"  # trailing "/" dropped: it is compared with the checkpoint's
    trainer = tiny_trainer(pl, 1, callbacks=[callback], plugins=[S3CheckpointIO(dirpath, chunk_size_MB=5)])
    trainer.ckpt_path = None
    plain = trainer._checkpoint_connector
    assert not isinstance(plain, connector.BroadcastResumeConnectorMixin)
    callback.setup(trainer, make_module(pl), "fit")
    assert isinstance(trainer._checkpoint_connector, connector.NeMoCheckpointConnector)
    assert trainer._checkpoint_connector.trainer is trainer
    assert callback.s3_utils is trainer.strategy.checkpoint_io.s3  # discovery uses the plugin's client


def test_install_leaves_custom_connectors_alone(caplog: pytest.LogCaptureFixture) -> None:
    pl = lightning_family("lightning.pytorch")
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    class Custom(_CheckpointConnector):
        pass

    trainer = tiny_trainer(pl, 1)
    trainer.ckpt_path = "s3://b/x.ckpt"
    installed = connector.install_checkpoint_connector(trainer)
    assert installed is connector.install_checkpoint_connector(trainer)  # idempotent
    assert trainer.ckpt_path == "s3://b/x.ckpt" and installed._user_managed  # state carried over
    trainer._checkpoint_connector = Custom(trainer)
    assert connector.install_checkpoint_connector(trainer) is trainer._checkpoint_connector
    assert "custom checkpoint connector" in caplog.text


def test_configure_refuses_to_replace_configured_pieces(bucket: str) -> None:
    pl = lightning_family("lightning.pytorch")
    config = nemo_style_config(f"s3://{bucket}/c")
    with pytest.raises(ValueError, match="already has a configured ModelCheckpoint"):
        connector.configure_s3_checkpointing(
            tiny_trainer(pl, 1, callbacks=[pl.callbacks.ModelCheckpoint(dirpath="/tmp/x")]), config
        )
    async_io = pl.plugins.AsyncCheckpointIO()
    with pytest.raises(ValueError, match="already has the checkpoint plugin AsyncCheckpointIO"):
        connector.configure_s3_checkpointing(tiny_trainer(pl, 1, plugins=[async_io]), config)


def test_build_accepts_omegaconf(bucket: str) -> None:
    omegaconf = pytest.importorskip("omegaconf")
    parts = connector.build_s3_checkpointing(omegaconf.OmegaConf.create(nemo_style_config(f"s3://{bucket}/c")))
    assert parts.checkpoint_callback.dirpath == f"s3://{bucket}/c"


def test_build_returns_trainer_kwargs(bucket: str, caplog: pytest.LogCaptureFixture) -> None:
    pl = lightning_family("pytorch_lightning")
    config = nemo_style_config(f"s3://{bucket}/c", resume_if_exists=True, resume_past_end=False)
    config["exp_manager"]["checkpoint_callback_params"]["save_top_K"] = 3
    parts = connector.build_s3_checkpointing(config, family="pytorch_lightning")
    assert "NeMoModelCheckpoint-only key(s) ['save_nemo_on_train_end']" in caplog.text
    assert "ignoring ['save_top_K']: not arguments of pytorch_lightning.ModelCheckpoint (a typo?)" in caplog.text
    assert isinstance(parts.checkpoint_callback, pl.callbacks.ModelCheckpoint)
    assert type(parts.checkpoint_callback).__name__ == "S3ModelCheckpointPL"
    assert parts.resume == {"resume_if_exists": True, "resume_past_end": False}
    trainer = tiny_trainer(pl, 1, **parts.trainer_kwargs)
    assert trainer.strategy.checkpoint_io is parts.checkpoint_io
    assert parts.checkpoint_callback.CHECKPOINT_NAME_LAST == "tiny--{step}-last"
    assert pl.callbacks.ModelCheckpoint.CHECKPOINT_NAME_LAST == "last"  # only the instance is renamed


def test_mixin_keeps_s3_top_k_entries_in_a_nemo_style_checkpoint_class(tmp_path) -> None:
    """NeMo's NeMoModelCheckpoint drops top-k entries for which os.path.isfile is False: every s3:// entry."""
    import os

    pl = lightning_family("lightning.pytorch")

    class NeMoLikeCheckpoint(pl.callbacks.ModelCheckpoint):  # NeMo's load_state_dict / top-k check, reduced
        def _remove_invalid_entries_from_topk(self) -> None:
            self.best_k_models = {k: v for k, v in self.best_k_models.items() if os.path.isfile(k)}
            self.best_model_path = self.kth_best_model_path = ""

        def load_state_dict(self, state_dict) -> None:
            super().load_state_dict(state_dict)
            self._remove_invalid_entries_from_topk()

    class NeMoS3Checkpoint(connector.S3ModelCheckpointMixin, NeMoLikeCheckpoint):
        pass

    local_kept = tmp_path / "a.ckpt"
    local_kept.write_bytes(b"x")
    state = {
        "monitor": "loss",
        "best_model_score": torch.tensor(0.1),
        "best_model_path": "s3://bkt/run/step=2.ckpt",
        "current_score": torch.tensor(0.3),
        "dirpath": "s3://bkt/run/",
        "best_k_models": {
            "s3://bkt/run/step=2.ckpt": torch.tensor(0.1),
            "s3://bkt/run/step=4.ckpt": torch.tensor(0.3),
            str(local_kept): torch.tensor(0.2),
            str(tmp_path / "gone.ckpt"): torch.tensor(0.05),
        },
        "kth_best_model_path": "s3://bkt/run/step=4.ckpt",
        "kth_value": torch.tensor(0.3),
        "last_model_path": "s3://bkt/run/last.ckpt",
    }
    callback = NeMoS3Checkpoint(dirpath="s3://bkt/run", monitor="loss", mode="min", save_top_k=3)
    callback.load_state_dict(state)
    assert list(callback.best_k_models) == ["s3://bkt/run/step=2.ckpt", "s3://bkt/run/step=4.ckpt", str(local_kept)]
    assert callback.best_model_path == "s3://bkt/run/step=2.ckpt"
    assert callback.kth_best_model_path == "s3://bkt/run/step=4.ckpt"
    assert callback.last_model_path == "s3://bkt/run/last.ckpt"  # dirpath matched despite the trailing "/"


def test_rank_zero_failure_is_raised_on_every_rank() -> None:
    from types import SimpleNamespace

    def failing() -> bool:
        raise PermissionError("AccessDenied on s3://bkt/run/last.ckpt")

    class Strategy:
        def broadcast(self, obj, src=0):
            return obj

    rank0 = SimpleNamespace(is_global_zero=True, world_size=2, strategy=Strategy())
    with pytest.raises(PermissionError, match="AccessDenied"):
        connector._on_rank_zero_then_broadcast(rank0, failing, "checking")

    class FromRankZero(Strategy):
        def broadcast(self, obj, src=0):
            return (None, "PermissionError('AccessDenied')")

    rank1 = SimpleNamespace(is_global_zero=False, world_size=2, strategy=FromRankZero())
    with pytest.raises(RuntimeError, match=r"Global rank 0 failed while checking: PermissionError"):
        connector._on_rank_zero_then_broadcast(rank1, failing, "checking")


@BOTH_BUCKET_KINDS
@pytest.mark.parametrize("family", FAMILIES)
def test_s3_traffic_goes_through_the_plugin_client_not_s3fs(
    family: str, bucket: str, s3_client, fault_proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the endpoint given only to S3CheckpointIO, saving, versioning, "last" and resuming all still work: the
    callback and connector ask S3 through the plugin's client. s3fs is pointed at a closed port to prove it."""
    pl = lightning_family(family)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # nothing listens there
    dirpath = f"s3://{bucket}/run"
    callback_class = connector.s3_model_checkpoint_class(family)

    def trainer_for(max_steps: int):
        plugin = S3CheckpointIO(dirpath, chunk_size_MB=5, endpoint_url=fault_proxy.endpoint_url)
        callback = callback_class(dirpath=dirpath, save_last=True, every_n_train_steps=2)
        trainer = tiny_trainer(pl, max_steps, plugins=[plugin], callbacks=[callback])
        connector.install_checkpoint_connector(trainer)
        return trainer

    trainer_for(4).fit(make_module(pl))
    resumed = trainer_for(6)
    module = make_module(pl)
    with pytest.warns(UserWarning, match="exists and is not empty"):
        resumed.fit(module, ckpt_path="last")
    assert module.started_at["global_step"] == 4 and resumed.ckpt_path == f"{dirpath}/last.ckpt"
    keys = sorted(o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket)["Contents"] if o["Key"].endswith("ckpt"))
    assert keys == ["run/epoch=0-step=6.ckpt", "run/last.ckpt"]
    assert fault_proxy.requests and not [r for r in fault_proxy.requests if "aiobotocore" in r.user_agent]
    # "last" was one listing on this (rank 0) process; no HEAD per candidate.
    assert fault_proxy.count(method="GET", query_contains="list-type=2") >= 1
