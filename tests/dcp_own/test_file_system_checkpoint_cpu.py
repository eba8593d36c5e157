# Vendored from pytorch/pytorch, test/distributed/checkpoint/test_file_system_checkpoint_cpu.py at commit
# 02dee1ad31d013c458c5071f1710da10a2d50392 (the stored version nearest to v2.13); BSD-3-Clause, Copyright (c) Meta
# Platforms, Inc. and affiliates and the PyTorch contributors.
# Adapted to run against s3_dcp on s3:// (tests/README.md, "torch's own DCP tests"); every edit is marked "# s3:".
# s3: FileSystemWriter / FileSystemReader are S3StorageWriter / S3StorageReader, a temporary directory is a fresh
# s3:// prefix (tests/dcp_own/s3_dcp_adapt.py).
# Owner(s): ["oncall: distributed"]

import importlib.util  # s3: for the zstandard skip below
from typing import IO, Any

import pytest  # s3: skips and xfails
import torch
import torch.distributed.checkpoint.default_planner  # s3: for the version skip below
from torch.distributed.checkpoint import (
    load,
    load_state_dict,
    save,
    save_state_dict,
)
from torch.distributed.checkpoint._extension import ZStandard
from torch.distributed.checkpoint.api import (
    CheckpointException,
)
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.testing._internal.distributed.checkpoint_utils import (
    Rot13Example,
    get_test_extension_registry,
)

from dcp_own.s3_dcp_adapt import FileSystemReader, FileSystemWriter  # s3: S3StorageReader / S3StorageWriter
from dcp_own.s3_dcp_adapt import TestCase, s3_prefix  # s3: pytest class with torch's assertions; s3:// prefixes
from dcp_own.s3_dcp_adapt import instantiate_parametrized_tests, parametrize  # s3: pytest's parametrize

# s3: torch's `TEST_WITH_DEV_DBG_ASAN` exit, `run_tests` and the ShardedTensor imports are gone with the two-rank
# classes (see the end of this file).

_THREAD_COUNTS = {1, 2}

_NO_EXTENSIONS = (  # s3: why the extension tests are expected to fail
    "S3StorageWriter has no stream transforms: it refuses torch's experimental `_extensions` by name with a "
    "ValueError, so torch's extension round trips cannot run on it"
)


def assert_state_dict_equal(
    self: TestCase,
    state_dict_1: dict[str, torch.Tensor],
    state_dict_2: dict[str, torch.Tensor],
) -> bool:
    self.assertEqual(len(state_dict_1), len(state_dict_2), "state_dict must be the same size")
    self.assertEqual(
        set(state_dict_1.keys()),
        set(state_dict_2.keys()),
        "state_dict keys do not match",
    )

    for key, value_1 in state_dict_1.items():
        value_2 = state_dict_2[key]
        # s3: the ShardedTensor branch went with the two-rank classes
        if isinstance(value_1, torch.Tensor):
            self.assertTrue(
                torch.equal(value_1, value_2),
                lambda msg: f"{msg}\nKey {key}'s tensor does not match",
            )
        elif isinstance(value_1, Stateful):
            self.assertEqual(value_1, value_2)

    return True


class MyTestModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_1 = torch.nn.Linear(5, 5)
        self.linear_2 = torch.nn.Linear(5, 1)
        self.emb = torch.nn.EmbeddingBag(5, 10)


class BlobState:
    def __init__(self, value: IO[bytes]) -> Any:
        self.state = {"blob": value}

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state = state_dict

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BlobState) and self.state == other.state

    def __repr__(self) -> str:
        return f"BlobState({self.state['blob']})"


class TestDistributedStateDictSaveLoad(TestCase):
    @parametrize("thread_count", _THREAD_COUNTS)
    def test_read_write_only_tensor(self, thread_count) -> None:
        with s3_prefix(self) as path:  # s3: a fresh s3:// prefix
            state_dict_to_save = MyTestModule().state_dict()

            fs_writer = FileSystemWriter(path=path, thread_count=thread_count)
            save_state_dict(
                state_dict=state_dict_to_save,
                storage_writer=fs_writer,
                no_dist=True,
            )

            state_dict_to_load_to = MyTestModule().state_dict()

            with self.assertRaises(AssertionError):
                assert_state_dict_equal(self, state_dict_to_load_to, state_dict_to_save)

            # Load from file without any resharding
            fs_reader = FileSystemReader(path=path)
            load_state_dict(
                state_dict=state_dict_to_load_to,
                storage_reader=fs_reader,
                no_dist=True,
            )

            assert_state_dict_equal(self, state_dict_to_load_to, state_dict_to_save)

    @pytest.mark.skipif(  # s3: the test is newer than torch 2.13
        "allow_unsafe_types" not in torch.distributed.checkpoint.default_planner.DefaultLoadPlanner.__init__.__code__.co_varnames,
        reason="DefaultLoadPlanner(allow_unsafe_types=...) is newer than this torch",
    )
    def test_dtype_mismatch_casting(self):
        with s3_prefix(self) as path:  # s3: a fresh s3:// prefix
            state_dict_fp32 = {"w": torch.rand(4, 3, dtype=torch.float32)}
            save(state_dict_fp32, storage_writer=FileSystemWriter(path))  # s3: checkpoint_id=path chooses fsspec

            # unsafe narrowing (fp32 checkpoint -> bf16 template)
            # by default (allow_unsafe_types=True), it silently casts for backward compatibility
            template_bf16_default = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}
            load(state_dict=template_bf16_default, storage_reader=FileSystemReader(path))  # s3: as above
            self.assertEqual(template_bf16_default["w"].dtype, torch.bfloat16)

            # strict mode (allow_unsafe_types=False) should block narrowing casts
            planner_strict = DefaultLoadPlanner(allow_unsafe_types=False)
            template_bf16_strict = {"w": torch.zeros(4, 3, dtype=torch.bfloat16)}

            with self.assertRaises(CheckpointException) as context:
                load(state_dict=template_bf16_strict, storage_reader=FileSystemReader(path), planner=planner_strict)  # s3: as above
            self.assertIn("dtype mismatch", str(context.exception))
            self.assertIn("Silent casting is not allowed", str(context.exception))

            # safe widening (bf16 checkpoint -> fp32 template)
            # even in strict mode, widening casts should be completely fine
            path_wide = path + "_wide"
            state_dict_bf16 = {"w": torch.rand(4, 3, dtype=torch.bfloat16)}
            save(state_dict_bf16, storage_writer=FileSystemWriter(path_wide))  # s3: as above

            template_fp32_wide = {"w": torch.zeros(4, 3, dtype=torch.float32)}
            load(state_dict=template_fp32_wide, storage_reader=FileSystemReader(path_wide), planner=planner_strict)  # s3: as above
            self.assertEqual(template_fp32_wide["w"].dtype, torch.float32)


class TestDistributedStateDictSaveLoadRot13(TestCase):
    @pytest.mark.xfail(raises=ValueError, strict=True, reason=_NO_EXTENSIONS)  # s3: see _NO_EXTENSIONS
    @parametrize("thread_count", _THREAD_COUNTS)
    def test_read_write_tensor_and_blob(self, thread_count) -> None:
        with s3_prefix(self) as path:  # s3: a fresh s3:// prefix
            state_dict_to_save = MyTestModule().state_dict()
            state_dict_to_save["test_blob"] = BlobState(b"SomeBlobForTesting")

            fs_writer = FileSystemWriter(
                path=path,
                thread_count=thread_count,
                _extensions=[Rot13Example()],
            )
            save(
                state_dict=state_dict_to_save,
                storage_writer=fs_writer,
            )

            state_dict_to_load_to = MyTestModule().state_dict()
            state_dict_to_load_to["test_blob"] = BlobState(b"")

            with self.assertRaises(AssertionError):
                assert_state_dict_equal(self, state_dict_to_load_to, state_dict_to_save)

            # Load from file without any resharding.  Note there is no extension
            # specification here; it is determined dynamically from the metadata.
            fs_reader = FileSystemReader(path=path, _extension_registry=get_test_extension_registry())
            load(
                state_dict=state_dict_to_load_to,
                storage_reader=fs_reader,
            )

            assert_state_dict_equal(self, state_dict_to_load_to, state_dict_to_save)


class TestDistributedStateDictSaveLoadZStandard(TestCase):
    @pytest.mark.skipif(  # s3: torch's ZStandard extension needs it
        importlib.util.find_spec("zstandard") is None, reason="zstandard is not installed"
    )
    @pytest.mark.xfail(raises=ValueError, strict=True, reason=_NO_EXTENSIONS)  # s3: see _NO_EXTENSIONS
    @parametrize("thread_count", _THREAD_COUNTS)
    def test_read_write_only_tensor(self, thread_count) -> None:
        with s3_prefix(self) as path:  # s3: a fresh s3:// prefix
            state_dict_to_save = MyTestModule().state_dict()
            state_dict_to_save["test_blob"] = BlobState(b"SomeBlobForTesting")

            fs_writer = FileSystemWriter(
                path=path,
                thread_count=thread_count,
                _extensions=[ZStandard()],
            )
            save(
                state_dict=state_dict_to_save,
                storage_writer=fs_writer,
            )

            state_dict_to_load_to = MyTestModule().state_dict()
            state_dict_to_load_to["test_blob"] = BlobState(b"")

            with self.assertRaises(AssertionError):
                assert_state_dict_equal(self, state_dict_to_load_to, state_dict_to_save)

            # Load from file without any resharding
            fs_reader = FileSystemReader(path=path)
            load(
                state_dict=state_dict_to_load_to,
                storage_reader=fs_reader,
            )

            assert_state_dict_equal(self, state_dict_to_load_to, state_dict_to_save)


# s3: the two-rank classes (TestDistributedStateDictSaveLoadWithSharedTensor, TestDistributedReshardOnLoad) run
# in tests/dcp_own/test_file_system_checkpoint_2ranks.py.

instantiate_parametrized_tests(TestDistributedStateDictSaveLoad)
instantiate_parametrized_tests(TestDistributedStateDictSaveLoadRot13)
instantiate_parametrized_tests(TestDistributedStateDictSaveLoadZStandard)
