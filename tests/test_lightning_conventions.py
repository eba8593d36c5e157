"""A real Lightning fit checkpoints to S3 through S3CheckpointIO and resumes bit for bit (either Lightning family,
sync and async), and S3ModelCheckpoint and S3CheckpointIO behave as Lightning's own classes do with a local
directory (the probes that failed when Lightning's own checkpoint tests ran on ``s3://``): name versioning that sees
async saves in flight, the callback's signature for LightningCLI, callback state that survives a switch of class,
Lightning's ``AsyncCheckpointIO`` around the plugin, and a test double as the plugin leaving no process-wide state
behind."""

from __future__ import annotations

import importlib
import inspect
import time
from collections.abc import Iterator
from unittest.mock import MagicMock

import pytest
import torch
from tiny_lightning import FAMILIES, TOP_K_CHECKPOINT, lightning_family, tiny_module_class, tiny_trainer

import connector
import s3_checkpoint_io
import s3_fencing
from s3_checkpoint_io import S3CheckpointIO
from s3_utils import fresh_s3fs_instances

pytestmark = pytest.mark.lightning


@pytest.fixture(autouse=True)
def _fresh_s3fs() -> Iterator[None]:
    pytest.importorskip("s3fs")
    with fresh_s3fs_instances():
        yield


def checkpoint_names(s3_client, bucket: str, prefix: str = "run/") -> set[str]:
    listing = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"].removeprefix(prefix) for o in listing if o["Key"].endswith(".ckpt")}


class SlowUploads(S3CheckpointIO):
    """An async plugin whose uploads start half a second late: each next save is issued while the last is in flight
    (a real checkpoint's upload takes longer than a tiny model's epoch)."""

    def _save_now(self, checkpoint: dict, path: str) -> s3_checkpoint_io.TransferRecord:
        if self.async_checkpointing:
            time.sleep(0.5)
        return super()._save_now(checkpoint, path)


# --------------------------------------------------------------------------------------------------------------------
# 1. Name versioning sees the saves in flight
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("async_checkpointing", [False, True], ids=["sync", "async"])
def test_ckpt_version_after_rerun_same_trainer(async_checkpointing: bool, s3_client, bucket: str) -> None:
    """Lightning's test of that name on ``s3://``: every save of ``test.ckpt`` gets the next ``-vN`` name. In async
    mode the second save used to find no ``test.ckpt`` yet (its upload was in flight) and overwrote it."""
    pl = lightning_family("lightning.pytorch")
    dirpath = f"s3://{bucket}/run"
    callback = connector.S3ModelCheckpoint(dirpath=dirpath, save_top_k=-1, monitor="epoch", mode="max", filename="test")
    callback.STARTING_VERSION = 9
    plugin = SlowUploads(dirpath, chunk_size_MB=5, async_checkpointing=async_checkpointing, max_saves_in_flight=4)
    module_class = tiny_module_class(pl, optimizer="sgd", samples=4)  # one step per epoch
    trainer = tiny_trainer(pl, -1, max_epochs=2, plugins=[plugin], callbacks=[callback])
    trainer.fit(module_class())
    trainer.fit_loop.max_epochs = 4
    trainer.fit(module_class())

    expected = {"test.ckpt", "test-v9.ckpt", "test-v10.ckpt", "test-v11.ckpt"}
    assert {url.rpartition("/")[2] for url in callback.best_k_models} == expected
    assert checkpoint_names(s3_client, bucket) == expected


@pytest.mark.parametrize("async_checkpointing", [False, True], ids=["sync", "async"])
def test_top_k_removals_stay_exact_with_saves_in_flight(async_checkpointing: bool, s3_client, bucket: str) -> None:
    """Top-2 of a rising score over 6 epochs, two runs into one dirpath: the same names and objects as Lightning
    leaves in a local directory, whether the uploads are in flight when the next save is named or not."""
    pl = lightning_family("lightning.pytorch")
    dirpath = f"s3://{bucket}/run"
    module_class = tiny_module_class(pl, optimizer="sgd", samples=4)

    def fit() -> object:
        callback = connector.S3ModelCheckpoint(dirpath=dirpath, save_top_k=2, monitor="epoch", mode="max")
        plugin = SlowUploads(dirpath, chunk_size_MB=5, async_checkpointing=async_checkpointing, max_saves_in_flight=3)
        tiny_trainer(pl, -1, max_epochs=3, plugins=[plugin], callbacks=[callback]).fit(module_class())
        return callback

    fit()
    second = fit()
    expected = {"epoch=1-step=2.ckpt", "epoch=2-step=3.ckpt", "epoch=1-step=2-v1.ckpt", "epoch=2-step=3-v1.ckpt"}
    assert checkpoint_names(s3_client, bucket) == expected
    assert {url.rpartition("/")[2] for url in second.best_k_models} == {
        "epoch=1-step=2-v1.ckpt",
        "epoch=2-step=3-v1.ckpt",
    }


# --------------------------------------------------------------------------------------------------------------------
# 2. LightningCLI and jsonargparse see ModelCheckpoint's parameters
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_the_signature_is_model_checkpoints_plus_s3_utils(family: str) -> None:
    pl = lightning_family(family)
    ours = inspect.signature(connector.s3_model_checkpoint_class(family)).parameters
    theirs = inspect.signature(pl.callbacks.ModelCheckpoint).parameters
    assert list(ours) == [*theirs, "s3_utils"]
    for name, parameter in theirs.items():
        assert (ours[name].default, ours[name].annotation, ours[name].kind) == (
            parameter.default,
            parameter.annotation,
            parameter.kind,
        ), name
    assert ours["s3_utils"].kind is inspect.Parameter.KEYWORD_ONLY and ours["s3_utils"].default is None


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("false", False), ("null", None), ("link", "link")])
def test_save_last_cli(value: str, expected: object) -> None:
    """Lightning's test of that name, on S3ModelCheckpoint: jsonargparse parses ``save_last`` by its annotation."""
    jsonargparse = pytest.importorskip("jsonargparse")
    annotation = inspect.signature(connector.S3ModelCheckpoint).parameters["save_last"].annotation
    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--a", type=annotation)
    assert parser.parse_args(["--a", value]).a == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_lightning_cli_builds_the_callback_from_a_config(
    family: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("jsonargparse")
    monkeypatch.setattr("sys.argv", ["train.py"])  # the config comes from args= alone
    pl = lightning_family(family)
    cli_module = pytest.importorskip(f"{family}.cli")
    name = "S3ModelCheckpoint" + ("PL" if family == "pytorch_lightning" else "")
    init_args = {"dirpath": f"s3://{bucket}/run", "monitor": "gstep", "save_last": True, "save_top_k": 3}
    config = {
        "trainer": {
            "callbacks": [{"class_path": f"connector.{name}", "init_args": init_args}],
            "logger": False,
            "enable_progress_bar": False,
            "max_steps": 1,
        }
    }
    cli = cli_module.LightningCLI(tiny_module_class(pl), args=config, run=False, save_config_callback=None)
    [callback] = [c for c in cli.trainer.callbacks if isinstance(c, connector.S3ModelCheckpointMixin)]
    assert type(callback) is connector.s3_model_checkpoint_class(family)
    assert (callback.dirpath, callback.monitor, callback.save_last, callback.save_top_k) == (
        f"s3://{bucket}/run",
        "gstep",
        True,
        3,
    )


# --------------------------------------------------------------------------------------------------------------------
# 5. Callback state survives a switch between ModelCheckpoint and S3ModelCheckpoint
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("direction", ["to_s3", "from_s3", "from_old_s3_key"])
def test_callback_state_carries_over_between_the_classes(family: str, direction: str, bucket: str) -> None:
    """Lightning files callback state under a key with the class name: resuming a ModelCheckpoint's checkpoint with
    S3ModelCheckpoint (or back) silently dropped best model, top-k and last path. ``from_old_s3_key``: a checkpoint
    whose state is under the ``S3ModelCheckpoint{...}`` key earlier versions wrote."""
    pl = lightning_family(family)
    dirpath = f"s3://{bucket}/run"
    s3_class, plain_class = connector.s3_model_checkpoint_class(family), pl.callbacks.ModelCheckpoint
    first_class, second_class = (s3_class, plain_class) if direction == "from_s3" else (plain_class, s3_class)

    def fit(callback_class: type, ckpt_path: str | None = None):
        callback = callback_class(dirpath=dirpath, **TOP_K_CHECKPOINT)
        plugin = S3CheckpointIO(dirpath, chunk_size_MB=5)
        trainer = tiny_trainer(pl, 4, plugins=[plugin], callbacks=[callback])
        trainer.fit(tiny_module_class(pl, optimizer="sgd")(), ckpt_path=ckpt_path)  # at step 4: restore only
        return callback, plugin

    first, plugin = fit(first_class)
    resume_from = f"{dirpath}/last.ckpt"
    if direction == "from_old_s3_key":
        checkpoint = plugin.load_checkpoint(resume_from, weights_only=False)
        [key] = checkpoint["callbacks"]
        old_key = s3_class.__qualname__ + key.removeprefix("ModelCheckpoint")
        checkpoint["callbacks"] = {old_key: checkpoint["callbacks"][key]}
        resume_from = f"{dirpath}/old.ckpt"
        plugin.save_checkpoint(checkpoint, resume_from)
    second, _ = fit(second_class, resume_from)
    assert first.best_model_path and second.best_model_path == first.best_model_path
    assert set(second.best_k_models) == set(first.best_k_models) and len(first.best_k_models) == 2
    assert second.last_model_path == first.last_model_path == f"{dirpath}/last.ckpt"


def test_state_key_is_model_checkpoints_and_a_subclass_keeps_its_own(bucket: str) -> None:
    pl = lightning_family("lightning.pytorch")
    options = {"dirpath": f"s3://{bucket}/run", "monitor": "gstep", "every_n_train_steps": 2}
    assert connector.S3ModelCheckpoint(**options).state_key == pl.callbacks.ModelCheckpoint(**options).state_key

    with pytest.raises(RuntimeError, match="more than one stateful callback"):  # as two ModelCheckpoints would
        pl.Trainer(callbacks=[connector.S3ModelCheckpoint(**options), pl.callbacks.ModelCheckpoint(**options)])

    class Mine(connector.S3ModelCheckpoint):
        pass

    assert Mine(**options).state_key.startswith(Mine.__qualname__ + "{")  # Lightning's rule for a user's own subclass


# --------------------------------------------------------------------------------------------------------------------
# 6. Lightning's AsyncCheckpointIO around the async plugin
# --------------------------------------------------------------------------------------------------------------------


def test_async_checkpoint_io_around_the_async_plugin_is_waited_for_and_stopped_by_fit(s3_client, bucket: str) -> None:
    """AsyncCheckpointIO's teardown stops its own thread only: the plugin's uploads were still running after fit,
    and its worker was never shut down. S3ModelCheckpoint's teardown now reaches the wrapped plugin."""
    pl = lightning_family("lightning.pytorch")
    dirpath = f"s3://{bucket}/run"
    plugin = SlowUploads(dirpath, chunk_size_MB=5, async_checkpointing=True, max_saves_in_flight=2)
    callback = connector.S3ModelCheckpoint(dirpath=dirpath, **TOP_K_CHECKPOINT)
    trainer = tiny_trainer(pl, 4, plugins=[pl.plugins.AsyncCheckpointIO(plugin)], callbacks=[callback])
    trainer.fit(tiny_module_class(pl, optimizer="sgd")())
    assert s3_checkpoint_io.pending_operation(f"{dirpath}/last.ckpt") is None
    assert plugin._executor is None, "the plugin's upload worker still runs after fit"
    assert checkpoint_names(s3_client, bucket) == {"last.ckpt", "tiny-step=2.ckpt", "tiny-step=4.ckpt"}


# --------------------------------------------------------------------------------------------------------------------
# 7. A test double as the plugin leaves no process-wide state behind
# --------------------------------------------------------------------------------------------------------------------


def test_a_test_double_as_the_plugin_does_not_break_later_saves(bucket: str) -> None:
    """Lightning's own tests wrap the plugin in ``MagicMock(wraps=..., spec=...)``: setup made the mock's ``run``
    this process's run, and every later fenced save failed ("Object of type MagicMock is not JSON serializable")."""
    pl = lightning_family("lightning.pytorch")
    dirpath = f"s3://{bucket}/run"
    before = s3_fencing.current_run()
    double = MagicMock(wraps=S3CheckpointIO(dirpath, chunk_size_MB=5), spec=S3CheckpointIO)
    callback = connector.S3ModelCheckpoint(dirpath=dirpath, **TOP_K_CHECKPOINT)
    try:
        tiny_trainer(pl, 2, plugins=[double], callbacks=[callback]).fit(tiny_module_class(pl, optimizer="sgd")())
        assert double.save_checkpoint.called
        assert s3_fencing.current_run() is before
        later = S3CheckpointIO(f"s3://{bucket}/later", chunk_size_MB=5)
        later.save_checkpoint({"step": 1}, f"s3://{bucket}/later/x.ckpt")
        assert later.load_checkpoint(f"s3://{bucket}/later/x.ckpt") == {"step": 1}
    finally:
        s3_fencing.adopt_run(before) if isinstance(s3_fencing.current_run(), s3_fencing.CheckpointRun) else None
    with pytest.raises(TypeError, match="CheckpointRun"):
        s3_fencing.adopt_run(MagicMock())



def make_trainer(pl, plugin, dirpath: str, max_steps: int):
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=dirpath, **TOP_K_CHECKPOINT)
    trainer = tiny_trainer(pl, max_steps, plugins=[plugin], callbacks=[checkpoint])
    return trainer, checkpoint


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("async_checkpointing", [False, True], ids=["sync", "async"])
def test_fit_checkpoints_to_s3_and_resumes(family: str, async_checkpointing: bool, s3_client, bucket: str) -> None:
    pl = lightning_family(family)
    module_class = tiny_module_class(pl, features=8, outputs=2)
    dirpath = f"s3://{bucket}/run"
    plugin = S3CheckpointIO(dirpath, chunk_size_MB=5, async_checkpointing=async_checkpointing)

    first = module_class()
    trainer, _ = make_trainer(pl, plugin, dirpath, max_steps=6)
    trainer.fit(first)
    final_weights = {k: v.clone() for k, v in first.state_dict().items()}
    final_optimizer = trainer.optimizers[0].state_dict()["state"]

    keys = sorted(o["Key"] for o in s3_client.list_objects_v2(Bucket=bucket).get("Contents", []))
    expected = ["run/last.ckpt", "run/tiny-step=4.ckpt", "run/tiny-step=6.ckpt"]
    assert [k for k in keys if k.endswith(".ckpt")] == expected
    assert not s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads")

    second = module_class()
    resume_plugin = S3CheckpointIO(dirpath, chunk_size_MB=5, async_checkpointing=async_checkpointing)
    resumed_trainer, _ = make_trainer(pl, resume_plugin, dirpath, max_steps=8)
    resumed_trainer.fit(second, ckpt_path=f"{dirpath}/last.ckpt")

    assert second.started_at is not None
    assert second.started_at["global_step"] == 6
    for name, tensor in final_weights.items():
        assert torch.equal(second.started_at["weights"][name], tensor), name
    for index, state in final_optimizer.items():
        for name, tensor in state.items():
            assert torch.equal(second.started_at["optimizer_state"][index][name], tensor), (index, name)
    assert resumed_trainer.global_step == 8


@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_accepts_the_plugin_for_either_family(family: str) -> None:
    pl = lightning_family(family)
    base = importlib.import_module(
        family.replace("pytorch_lightning", "lightning_fabric").replace("lightning.pytorch", "lightning.fabric")
        + ".plugins.io.checkpoint_io"
    ).CheckpointIO
    plugin = S3CheckpointIO("s3://bucket/ckpts")
    assert isinstance(plugin, base)
    trainer = pl.Trainer(accelerator="cpu", devices=1, plugins=[plugin], logger=False)
    assert trainer.strategy.checkpoint_io is plugin
