"""Every fast path against its reference path, byte for byte (`s3_utils.FAST_PATHS`, switched by
`s3_utils.REFERENCE_PATHS_ENV`): the objects a save writes and the tensors a load fills are the same either way.

The state is a small GPT-style checkpoint as Lightning saves it (bf16 parameters, fp32 Adam moments under
``optimizer_states``, scalars), with tensors larger than the 5 MiB part (borrowed parts), smaller than it, unaligned
to the part grid, and repeated kinds (framing reuse). benchmarks/realistic.md weighs what each path gains.
"""

from __future__ import annotations

import io
import re
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from read_counts import counting_reads  # noqa: E402

import s3_dcp  # noqa: E402
import s3_utils  # noqa: E402
from s3_checkpoint_io import S3CheckpointIO  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

MiB = 1024**2


def _gpt_checkpoint(d: int = 256, layers: int = 2, vocab: int = 12288) -> dict[str, Any]:
    """Parameters bf16 (the embedding 6 MiB, its fp32 moments 12 MiB: over two 5 MiB parts), moments fp32."""
    generator = torch.Generator().manual_seed(5)
    shapes = [("wte.weight", (vocab, d))]
    for n in range(layers):
        shapes += [
            (f"h.{n}.ln_1.weight", (d,)),
            (f"h.{n}.attn.c_attn.weight", (3 * d, d)),
            (f"h.{n}.attn.c_attn.bias", (3 * d,)),
            (f"h.{n}.attn.c_proj.weight", (d, d)),
            (f"h.{n}.mlp.c_fc.weight", (4 * d, d)),
            (f"h.{n}.mlp.c_proj.weight", (d, 4 * d)),
        ]
    params = {name: torch.randn(shape, generator=generator).to(torch.bfloat16) for name, shape in shapes}
    moments = {
        index: {
            "step": torch.tensor(12.0),
            "exp_avg": torch.randn(shape, generator=generator),
            "exp_avg_sq": torch.rand(shape, generator=generator),
        }
        for index, (_, shape) in enumerate(shapes)
    }
    return {
        "epoch": 1,
        "global_step": 12,
        "state_dict": params,
        "optimizer_states": [{"state": moments, "param_groups": [{"lr": 1e-3, "params": list(moments)}]}],
        "loops": {"fit_loop": {"epoch_progress": {"total": {"completed": 1}}}},
        "callbacks": {"ModelCheckpoint": {"best_model_score": 1.5}},
    }


def _body(s3_client: Any, bucket: str, key: str) -> bytes:
    """An object's bytes (through s3transfer, as other tests read them: botocore's own check of a get_object answer
    does not know a multipart object's full-object checksum on every store)."""
    body = io.BytesIO()
    s3_client.download_fileobj(bucket, key, body)
    return body.getvalue()


def _objects(s3_client: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])
    return {o["Key"][len(prefix) + 1 :]: _body(s3_client, bucket, o["Key"]) for o in listed}


def test_the_switch_names_only_known_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(s3_utils.REFERENCE_PATHS_ENV, raising=False)
    assert all(s3_utils.fast_path(name) for name in s3_utils.FAST_PATHS)
    monkeypatch.setenv(s3_utils.REFERENCE_PATHS_ENV, "borrowed_parts, framing_reuse")
    assert not s3_utils.fast_path("borrowed_parts") and not s3_utils.fast_path("framing_reuse")
    assert s3_utils.fast_path("direct_reads")
    monkeypatch.setenv(s3_utils.REFERENCE_PATHS_ENV, "all")
    assert not any(s3_utils.fast_path(name) for name in s3_utils.FAST_PATHS)
    with pytest.raises(ValueError, match="unknown fast path"):
        s3_utils.fast_path("held")


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("reference", ["borrowed_parts", "all"])
def test_single_file_save_is_the_same_object_on_either_path(
    reference: str, mode: str, bucket: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The object a save writes is identical with the fast path on and on its reference path, and loads back."""
    checkpoint = _gpt_checkpoint()
    borrowed: list[int] = []
    real = s3_utils.S3MultipartWriter._send_borrowed_part
    spy = lambda writer, view, owner: borrowed.append(len(view)) or real(writer, view, owner)  # noqa: E731
    monkeypatch.setattr(s3_utils.S3MultipartWriter, "_send_borrowed_part", spy)
    bodies = {}
    for label, env in (("fast", ""), ("reference", reference)):
        monkeypatch.setenv(s3_utils.REFERENCE_PATHS_ENV, env)
        borrowed.clear()
        plugin = S3CheckpointIO(f"s3://{bucket}/{label}", chunk_size_MB=5, async_checkpointing=mode == "async")
        url = f"s3://{bucket}/{label}/{mode}-{reference}.ckpt"
        plugin.save_checkpoint(checkpoint, url)
        plugin.teardown()
        bodies[label] = _body(s3_client, bucket, url.split("/", 3)[3])
        assert bool(borrowed) == (label == "fast"), label  # the fast path ran only when on
    assert bodies["fast"] == bodies["reference"]
    loaded = torch.load(io.BytesIO(bodies["fast"]), weights_only=True)
    assert torch.equal(loaded["state_dict"]["wte.weight"], checkpoint["state_dict"]["wte.weight"])
    moments, expected = loaded["optimizer_states"][0]["state"][3], checkpoint["optimizer_states"][0]["state"][3]
    assert torch.equal(moments["exp_avg_sq"], expected["exp_avg_sq"])


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    """DCP's view of the checkpoint: the model and optimizer tensors, plus its scalars."""
    return {
        "model": dict(state["state_dict"]),
        "optim": {str(k): dict(v) for k, v in state["optimizer_states"][0]["state"].items()},
        "global_step": state["global_step"],
    }


def _empty(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _empty(v) for k, v in value.items()}
    return torch.full_like(value, -1) if isinstance(value, torch.Tensor) else value


def _same(got: Any, expected: Any) -> None:
    if isinstance(expected, dict):
        assert set(got) == set(expected)
        for key in expected:
            _same(got[key], expected[key])
    elif isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    else:
        assert got == expected


@pytest.mark.parametrize("reference", ["borrowed_parts", "framing_reuse", "all"])
def test_dcp_save_writes_the_same_files_on_either_path(
    reference: str, bucket: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every data file of a DCP save is identical with the fast path on and on its reference path but for the nonce
    each file ends with (``.metadata`` carries a save id of its own, so it is compared by what it loads)."""
    state = _flat(_gpt_checkpoint())
    files = {}
    for label, env in (("fast", ""), ("reference", reference)):
        monkeypatch.setenv(s3_utils.REFERENCE_PATHS_ENV, env)
        writer = s3_dcp.S3StorageWriter(f"s3://{bucket}/{label}-{reference}", chunk_size_MB=5, max_write_concurrency=2)
        dcp.save(state, storage_writer=writer, no_dist=True)
        files[label] = _objects(s3_client, bucket, f"{label}-{reference}")
    data = sorted(name for name in files["fast"] if name.endswith(".distcp"))
    assert data and data == sorted(name for name in files["reference"] if name.endswith(".distcp"))
    for name in data:
        fast, slow = files["fast"][name], files["reference"][name]
        assert re.fullmatch(rb"s3ckpt-nonce [0-9a-f]{32}\n", fast[-46:]) and fast[-46:] != slow[-46:], name
        assert fast[:-46] == slow[:-46], name
    monkeypatch.setenv(s3_utils.REFERENCE_PATHS_ENV, "")
    for label in ("fast", "reference"):
        loaded = _empty(state)
        dcp.load(loaded, storage_reader=s3_dcp.S3StorageReader(f"s3://{bucket}/{label}-{reference}"), no_dist=True)
        _same(loaded, state)


@pytest.mark.parametrize(
    ("fast", "reference"),
    [
        ("", "window_reads"),
        ("window_reads", "window_reads,direct_reads"),
        ("window_reads", "window_reads,scatter_reads"),
        ("", "span_reads"),
        ("", "all"),
    ],
)
def test_dcp_load_fills_the_same_tensors_on_either_path(
    fast: str, reference: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DCP load fills every target identically with a fast path on (`fast` names the paths off in both runs) and
    on its reference path, and the fast path is what ran when on (counted from outside the reader)."""
    state = _flat(_gpt_checkpoint())
    url = f"s3://{bucket}/load-{reference}"
    monkeypatch.setenv(s3_utils.REFERENCE_PATHS_ENV, "")
    dcp.save(state, storage_writer=s3_dcp.S3StorageWriter(url, chunk_size_MB=5), no_dist=True)
    stats = {}
    real_scatter, real_windows = s3_dcp._scatter, s3_dcp._windows
    scattered: list[bool] = []
    windows: list[Any] = []
    monkeypatch.setattr(s3_dcp, "_scatter", lambda *a: scattered.append(real_scatter(*a)) or scattered[-1])
    monkeypatch.setattr(s3_dcp, "_windows", lambda *a: windows.extend(real_windows(*a)) or windows[-len(windows) :])
    for label, env in (("fast", fast), ("reference", reference)):
        monkeypatch.setenv(s3_utils.REFERENCE_PATHS_ENV, env)
        loaded = _empty(state)
        reader = s3_dcp.S3StorageReader(url, chunk_size_MB=5, direct_read_min_MB=None if fast == "" else 1)
        scattered.clear()
        windows.clear()
        with counting_reads() as counts:
            dcp.load(loaded, storage_reader=reader, no_dist=True)
        _same(loaded, state)
        stats[label] = {**counts, "scattered_groups": sum(scattered), "windows": len(windows)}
    on, off = stats["fast"], stats["reference"]
    assert on["recorded_spans"] > 0
    if "window_reads" not in fast:  # every GET is a window, fewer than groups of whole items and direct reads send
        assert on["windows"] == on["requests"] > 0 and off["windows"] == 0
        assert reference != "window_reads" or on["requests"] < off["requests"]
    else:
        assert on["direct_items"] > 0 and on["scattered_groups"] > 0
    if "direct_reads" in reference and "direct_reads" not in fast:
        assert off["direct_items"] == 0
    if "span_reads" in reference or reference == "all":
        assert off["recorded_spans"] == 0
    if "scatter_reads" in reference and "scatter_reads" not in fast:
        assert off["scattered_groups"] == 0


@pytest.mark.parametrize(
    ("read_path", "reference"),
    [
        ("ReadPath", "all"),
        ("SpanReads", "direct_reads,scatter_reads"),
        ("DirectReads", "scatter_reads"),
        ("ScatterReads", "direct_reads,window_reads"),
        ("WindowReads", "direct_reads"),
        ("DirectScatterReads", "window_reads"),
    ],
)
def test_the_read_path_argument_chooses_what_the_switch_does(
    read_path: str, reference: str, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``S3StorageReader(read_path=...)`` reads as the environment switch does for the same paths, whatever the
    switch says; the default is `FastReads`."""
    state = _flat(_gpt_checkpoint(layers=1))
    url = f"s3://{bucket}/read-path-{read_path}"
    dcp.save(state, storage_writer=s3_dcp.S3StorageWriter(url, chunk_size_MB=5), no_dist=True)
    monkeypatch.delenv(s3_utils.REFERENCE_PATHS_ENV, raising=False)
    assert type(s3_dcp.S3StorageReader(url).read_path) is s3_dcp.FastReads
    runs = []
    for env, path in ((reference, None), ("", getattr(s3_dcp, read_path)())):
        monkeypatch.setenv(s3_utils.REFERENCE_PATHS_ENV, env)
        loaded = _empty(state)
        with counting_reads() as counts:
            reader = s3_dcp.S3StorageReader(url, chunk_size_MB=5, direct_read_min_MB=1, read_path=path)
            dcp.load(loaded, storage_reader=reader, no_dist=True)
        _same(loaded, state)
        runs.append(counts)
    assert runs[0] == runs[1]
    with pytest.raises(TypeError, match="read_path must be a ReadPath"):
        s3_dcp.S3StorageReader(url, read_path="direct")  # type: ignore[arg-type]
