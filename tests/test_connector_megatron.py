"""Resume discovery (`connector`) for megatron-core checkpoints: Megatron-LM's ``iter_NNNNNNN`` directories and NeMo
2.x's ``<checkpoint>/weights/`` layout, complete only once DCP's ``.metadata`` and megatron-core's ``metadata.json``
are both where the checkpoint's files are. The same layouts as local files and as objects on S3 (moto)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import connector

pytestmark = [pytest.mark.megatron]  # no megatron-core needed: CI's second environment runs it beside test_mcore

COMPLETE = [".metadata", ".s3ckpt-items.json", "__0_0.distcp", "__1_0.distcp", "metadata.json"]
NO_CONFIG = [".metadata", "__0_0.distcp", "__1_0.distcp"]  # finalize step never ran
NO_COMMIT = ["__0_0.distcp", "__1_0.distcp"]  # upload interrupted


class LocalLayout:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    def put(self, relative: str) -> None:
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")


class S3Layout:
    def __init__(self, client: Any, bucket: str) -> None:
        self.client, self.bucket = client, bucket
        self.url = f"s3://{bucket}/ckpt"

    def put(self, relative: str) -> None:
        self.client.put_object(Bucket=self.bucket, Key=f"ckpt/{relative}", Body=b"x")


@pytest.fixture(params=["local", "s3"])
def layout(request: pytest.FixtureRequest, tmp_path: Path, s3_client: Any, bucket: str) -> Any:
    if request.param == "local":
        return LocalLayout(tmp_path / "ckpt")
    return S3Layout(s3_client, bucket)


def _checkpoint(layout: Any, folder: str, names: list[str]) -> None:
    for name in names:
        layout.put(f"{folder}/{name}")
    time.sleep(0.01)


def test_megatron_lm_iterations(layout: Any) -> None:
    """The newest iteration whose save finished (``.metadata`` and ``metadata.json``) is resumed from."""
    _checkpoint(layout, "iter_0000100", COMPLETE)
    _checkpoint(layout, "iter_0000200", NO_CONFIG)
    _checkpoint(layout, "iter_0000300", NO_COMMIT)
    layout.put("latest_checkpointed_iteration.txt")
    candidates = {c.name: c for c in connector.list_resume_candidates(layout.url)}
    assert sorted(candidates) == ["iter_0000100", "iter_0000200", "iter_0000300"]
    assert candidates["iter_0000100"].step == 100 and candidates["iter_0000100"].problem is None
    assert candidates["iter_0000100"].is_dcp
    assert "metadata.json" in candidates["iter_0000200"].problem
    assert ".metadata" in candidates["iter_0000300"].problem
    assert connector.find_resume_checkpoint(layout.url).endswith("/iter_0000100")


def test_nemo2_weights_folder(layout: Any) -> None:
    """NeMo 2.x: ``<name>-last/weights/`` holds the files; ``context/`` beside it does not decide anything."""
    done = "model--step=10-consumed_samples=80.0-last"
    unfinished = "model--step=20-consumed_samples=160.0-last"
    _checkpoint(layout, f"{done}/weights", COMPLETE)
    layout.put(f"{done}/context/model.yaml")
    _checkpoint(layout, f"{unfinished}/weights", NO_CONFIG)
    layout.put(f"{unfinished}/context/model.yaml")
    candidates = {c.name: c for c in connector.list_resume_candidates(layout.url)}
    assert candidates[done].problem is None and candidates[done].is_dcp and candidates[done].step == 10
    assert "metadata.json" in candidates[unfinished].problem
    assert connector.find_resume_checkpoint(layout.url).endswith(f"/{done}")


def test_plain_dcp_directories_need_no_megatron_marker() -> None:
    assert connector.megatron_checkpoint_problem(NO_CONFIG) is None
    assert connector.megatron_checkpoint_problem([*NO_CONFIG, "common.pt"]) is not None  # megatron-core <= 0.18
    assert connector.megatron_checkpoint_problem(COMPLETE, is_megatron=True) is None
    assert connector.classify_checkpoint_name("iter_0000100", True) == "last"
    assert connector.classify_checkpoint_name("iter_0000100", False) is None
    assert connector.checkpoint_step("iter_0001234") == 1234
