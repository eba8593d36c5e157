"""`s3_dcp.S3SavePlanner` / `S3LoadPlanner`: each DTensor's chunk computed arithmetically gives exactly what torch's
default planners give.

* `_shard_chunk` against torch's own ``_compute_local_shape_and_global_offset`` for every coordinate of many meshes
  (1-D to 3-D), shapes (empty, uneven, 1-4 dims) and placement combinations of ``Shard(d)`` and ``Replicate()``;
  anything else is left to torch (None).
* Two real gloo ranks (tests/helpers/planner_worker.py): local and global save plans, ``.metadata`` and shard files of
  a real ``dcp.save``, local load plans and a ``dcp.load`` back, equal to the default planners', with torch's index
  building function called only for the ``_StridedShard`` case.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset  # noqa: E402
from torch.distributed.tensor.placement_types import Partial, _StridedShard  # noqa: E402

import s3_dcp  # noqa: E402

HELPERS = Path(__file__).resolve().parent / "helpers"

MESHES = [(1,), (2,), (3,), (4,), (2, 2), (2, 3), (3, 2), (1, 2), (2, 1), (2, 1, 2), (2, 2, 2)]
SHAPES = [(0,), (1,), (2,), (7,), (8,), (13,), (0, 4), (7, 3), (2, 5), (5, 1, 3), (3, 4, 5), (1, 2, 3, 4)]


def _placement_options(ndim: int) -> list[object]:
    return [Replicate(), *(Shard(d) for d in range(ndim))]


def test_chunks_equal_torchs_for_every_coordinate_of_many_meshes_shapes_and_placements() -> None:
    compared = 0
    for mesh_shape in MESHES:
        coordinates = list(itertools.product(*(range(n) for n in mesh_shape)))
        for shape in SHAPES:
            for placements in itertools.product(_placement_options(len(shape)), repeat=len(mesh_shape)):
                for coordinate in coordinates:
                    expected = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements)
                    got = s3_dcp._shard_chunk(shape, mesh_shape, coordinate, placements)
                    assert got == expected, (shape, mesh_shape, coordinate, placements)
                    compared += 1
    assert compared > 5_000


@pytest.mark.parametrize(
    "placements",
    [
        [_StridedShard(0, split_factor=2)],
        [Partial()],
        [Shard(1)],  # a dimension the tensor does not have
    ],
)
def test_other_placements_are_left_to_torch(placements: list[object]) -> None:
    assert s3_dcp._shard_chunk((8,), (2,), (1,), tuple(placements)) is None


def test_a_coordinate_outside_the_mesh_is_left_to_torch() -> None:
    assert s3_dcp._shard_chunk((8,), (2,), (2,), (Shard(0),)) is None
    assert s3_dcp._shard_chunk((8,), (2, 2), (1,), (Shard(0), Shard(0))) is None


@pytest.mark.slow
def test_plans_metadata_and_files_equal_the_default_planners_at_two_gloo_ranks(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HELPERS), *sys.path])}
    command = [sys.executable, "-m", "planner_worker", "--out", str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"ranks failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["ok"], f"rank {rank}: {result.get('error')}\n{result.get('trace')}"
        failed = [name for name, passed in result["checks"].items() if not passed]
        assert failed == [], f"rank {rank}: {failed}; differences {result.get('differences')}"
        expected = {".metadata equal", "shard files identical"} if rank == 0 else set()
        expected |= {
            "local save plans equal",
            "plans with torch's code when torch does not ask",
            "local save plan has every item",
            "global save plans equal",
            "global metadata equal",
            "local load plans equal",
            "loaded equal to saved",
        }
        assert set(result["checks"]) == expected
        calls = result["calls"]
        dtensors = 14  # planner_worker._cases()
        assert calls["save plan torch"] == calls["load plan torch"] == dtensors, calls  # the counter sees torch's
        assert calls["save plan ours"] == calls["load plan ours"] == calls["load ours"] == 1, calls  # _StridedShard
        assert calls["save ours"] == 1 and calls["save torch"] == dtensors, calls
