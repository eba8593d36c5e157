"""What a Lightning job really saves: a GPT-style model's checkpoint, for the save/load benchmarks.

The shapes are a GPT-2 style decoder (nanoGPT's layout): token embedding ``vocab x d`` (tied with the output head,
so stored once), position embedding ``context x d``, and per layer two layer norms (weight and bias of ``d``),
attention ``qkv`` ``d x 3d`` and ``proj`` ``d x d``, MLP ``fc`` ``d x 4d`` and ``proj`` ``4d x d``, each with its
bias, then a final layer norm. Parameters are bf16 (as a bf16 mixed-precision job keeps them); Adam's ``exp_avg``
and ``exp_avg_sq`` are fp32 and sit under ``optimizer_states`` with a ``step`` per parameter, as
``torch.optim.AdamW.state_dict()`` returns them; around them the scalars and the ``loops`` / ``callbacks`` /
``lr_schedulers`` state Lightning's ``Trainer.save_checkpoint`` adds.

Sizes: ``d=768, layers=8`` (vocab 50,304, context 1,024) is 96.6 M parameters, 0.90 GiB with optimizer states
(bf16 parameters 184 MiB, fp32 moments 737 MiB); ``d=256, layers=2`` (about 70 MiB) is for quick runs. Apart from the
embeddings every tensor is smaller than the package's 16 MiB part, as in most real models.

`checkpoint` builds the single-file dict, `sharded_state` the DCP variant (DTensors sharded on dim 0 over the ranks,
``{"model": ..., "optim": ..., scalars}``), `assert_equal` checks a load bit for bit. Values come from fixed seeds,
so any process rebuilds the same state.

    python benchmarks/realistic_state.py --d 768 --layers 8    # prints the layout and sizes
"""

from __future__ import annotations

import argparse
import zlib
from typing import Any

MiB = 1024**2
VOCAB = 50304  # GPT-2's 50,257 padded to a multiple of 64 (nanoGPT), so dim 0 splits evenly over ranks
CONTEXT = 1024


def parameter_shapes(d: int, layers: int, vocab: int = VOCAB, context: int = CONTEXT) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every parameter, in ``named_parameters()`` order."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("transformer.wte.weight", (vocab, d)), ("transformer.wpe.weight", (context, d))]
    for n in range(layers):
        p = f"transformer.h.{n}."
        shapes += [
            (p + "ln_1.weight", (d,)),
            (p + "ln_1.bias", (d,)),
            (p + "attn.c_attn.weight", (3 * d, d)),
            (p + "attn.c_attn.bias", (3 * d,)),
            (p + "attn.c_proj.weight", (d, d)),
            (p + "attn.c_proj.bias", (d,)),
            (p + "ln_2.weight", (d,)),
            (p + "ln_2.bias", (d,)),
            (p + "mlp.c_fc.weight", (4 * d, d)),
            (p + "mlp.c_fc.bias", (4 * d,)),
            (p + "mlp.c_proj.weight", (d, 4 * d)),
            (p + "mlp.c_proj.bias", (d,)),
        ]
    shapes += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]
    return shapes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def tensor_bytes(d: int, layers: int) -> int:
    """Bytes of all tensors: bf16 parameters plus two fp32 moments each (the ``step`` scalars are negligible)."""
    return sum(_numel(shape) * (2 + 4 + 4) for _, shape in parameter_shapes(d, layers))


def size_mib(d: int, layers: int) -> float:
    return tensor_bytes(d, layers) / MiB


def _seed(name: str, kind: str, rank: int = 0) -> int:
    return zlib.crc32(f"{name}/{kind}/{rank}".encode())


def _values(shape: tuple[int, ...], dtype: Any, seed: int, kind: str) -> Any:
    import torch

    generator = torch.Generator().manual_seed(seed)
    if kind == "exp_avg_sq":  # second moments are positive and small
        return torch.rand(shape, generator=generator, dtype=torch.float32).mul_(1e-4).to(dtype)
    scale = 1e-3 if kind == "exp_avg" else 0.02
    return torch.randn(shape, generator=generator, dtype=torch.float32).mul_(scale).to(dtype)


def _param_groups(count: int) -> list[dict[str, Any]]:
    decay = list(range(0, count, 2))
    no_decay = list(range(1, count, 2))
    common = {"lr": 6e-4, "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": False, "maximize": False, "foreach": None,
              "capturable": False, "differentiable": False, "fused": None, "initial_lr": 6e-4}
    return [{**common, "weight_decay": 0.1, "params": decay}, {**common, "weight_decay": 0.0, "params": no_decay}]


def _lightning_extras(step: int) -> dict[str, Any]:
    """The scalars and loop / callback state ``Trainer.save_checkpoint`` adds next to the model and optimizer."""
    progress = {"total": {"ready": step, "completed": step}, "current": {"ready": step, "completed": step}}
    return {
        "epoch": 3,
        "global_step": step,
        "pytorch-lightning_version": "2.5.0",
        "loops": {
            "fit_loop": {
                "state_dict": {},
                "epoch_loop.state_dict": {"_batches_that_stepped": step},
                "epoch_loop.batch_progress": {**progress, "is_last_batch": False},
                "epoch_loop.automatic_optimization.optim_progress": {
                    "optimizer": {"step": progress, "zero_grad": progress}
                },
                "epoch_progress": progress,
            },
            "validate_loop": {"state_dict": {}, "batch_progress": progress},
        },
        "callbacks": {
            "ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min'}": {
                "monitor": "val_loss",
                "best_model_score": 2.8431,
                "best_model_path": "s3://bucket/run/epoch=2-step=1200.ckpt",
                "current_score": 2.9012,
                "dirpath": "s3://bucket/run",
                "best_k_models": {"s3://bucket/run/epoch=2-step=1200.ckpt": 2.8431},
                "kth_best_model_path": "s3://bucket/run/epoch=2-step=1200.ckpt",
                "kth_value": 2.8431,
                "last_model_path": "s3://bucket/run/last.ckpt",
            },
            "LearningRateMonitor": {},
        },
        "lr_schedulers": [{"base_lrs": [6e-4, 6e-4], "last_epoch": step, "_step_count": step + 1,
                           "_last_lr": [5.9e-4, 5.9e-4], "T_max": 100000, "eta_min": 6e-5}],
        "hparams_name": "kwargs",
        "hyper_parameters": {"n_layer": 8, "n_embd": 768, "vocab_size": VOCAB, "block_size": CONTEXT, "lr": 6e-4},
    }


def checkpoint(d: int, layers: int, step: int = 1234) -> dict[str, Any]:
    """The single-file checkpoint ``Trainer.save_checkpoint`` writes for this model with AdamW."""
    import torch

    shapes = parameter_shapes(d, layers)
    state_dict = {name: _values(shape, torch.bfloat16, _seed(name, "param"), "param") for name, shape in shapes}
    optimizer_state = {
        index: {
            "step": torch.tensor(float(step)),
            "exp_avg": _values(shape, torch.float32, _seed(name, "exp_avg"), "exp_avg"),
            "exp_avg_sq": _values(shape, torch.float32, _seed(name, "exp_avg_sq"), "exp_avg_sq"),
        }
        for index, (name, shape) in enumerate(shapes)
    }
    return {
        **_lightning_extras(step),
        "state_dict": state_dict,
        "optimizer_states": [{"state": optimizer_state, "param_groups": _param_groups(len(shapes))}],
    }


# ---- the sharded (DCP) variant -------------------------------------------------------------------------------------


def local_tensors(d: int, layers: int, rank: int, world_size: int, fill: bool) -> list[tuple[tuple[str, ...], Any]]:
    """This rank's shards, ``(path, local tensor)`` in a fixed order: every parameter (bf16) and both moments (fp32)
    split on dim 0. ``fill=False`` gives touched targets of the same shapes (for loads)."""
    import torch

    out: list[tuple[tuple[str, ...], Any]] = []
    for name, shape in parameter_shapes(d, layers):
        if shape[0] % world_size:
            raise ValueError(f"{name} {shape}: dim 0 does not split over {world_size} ranks")
        local = (shape[0] // world_size, *shape[1:])
        for path, dtype, kind in (
            (("model", name), torch.bfloat16, "param"),
            (("optim", "state", name, "exp_avg"), torch.float32, "exp_avg"),
            (("optim", "state", name, "exp_avg_sq"), torch.float32, "exp_avg_sq"),
        ):
            if fill:
                tensor = _values(local, dtype, _seed(name, kind, rank), kind)
            else:
                tensor = torch.empty(local, dtype=dtype).fill_(-1)
            out.append((path, tensor))
    return out


def sharded_state(
    mesh: Any, tensors: list[tuple[tuple[str, ...], Any]], d: int, layers: int, tensors_only: bool = False
) -> dict[str, Any]:
    """The DCP state: ``{"model": {name: DTensor}, "optim": {"state": {name: {...}}, "param_groups": ...}}`` plus
    Lightning's scalars and loop state (saved as DCP byte items); with `tensors_only` the DTensors alone (what a
    conversion to one safetensors file keeps)."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    state: dict[str, Any] = {"optim": {"state": {}, "param_groups": _param_groups(len(parameter_shapes(d, layers)))}}
    global_shapes = dict(parameter_shapes(d, layers))
    for path, local in tensors:
        name = path[1] if path[0] == "model" else path[2]
        shape = global_shapes[name]
        stride = torch.empty(0).new_empty(shape, device="meta").stride()
        value = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)
        node = state
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
        if path[0] == "optim" and path[-1] == "exp_avg" and not tensors_only:
            node["step"] = torch.tensor(1234.0)
    if tensors_only:
        del state["optim"]["param_groups"]
        return state
    extras = _lightning_extras(1234)
    state.update({k: v for k, v in extras.items() if k in ("epoch", "global_step", "loops", "callbacks")})
    return state


def assert_equal(got: Any, expected: Any, path: str = "") -> None:
    """Raise AssertionError at the first difference (tensors bit for bit, dtype and shape included)."""
    import torch

    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert got.dtype == expected.dtype and got.shape == expected.shape, (path, got.dtype, got.shape)
        assert torch.equal(got.view(torch.uint8) if got.dim() else got, expected.view(torch.uint8) if expected.dim() else expected), path
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and sorted(map(str, got)) == sorted(map(str, expected)), path
        for key, value in expected.items():
            assert_equal(got[key], value, f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), path
        for n, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert_equal(a, b, f"{path}[{n}]")
    else:
        assert got == expected, (path, got, expected)


def full_tensors(d: int, layers: int, world_size: int = 2) -> dict[str, Any]:
    """The sharded state's tensors, whole (every rank's dim-0 shards concatenated), by DCP's flattened name."""
    import torch

    shards = [local_tensors(d, layers, rank, world_size, fill=True) for rank in range(world_size)]
    return {".".join(path): torch.cat([s[n][1] for s in shards]) for n, (path, _) in enumerate(shards[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    shapes = parameter_shapes(args.d, args.layers)
    params = sum(_numel(s) for _, s in shapes)
    tensors = [_numel(s) * b for _, s in shapes for b in (2, 4, 4)]
    print(f"d={args.d} layers={args.layers}: {len(shapes)} parameters, {params / 1e6:.1f} M elements, "
          f"{len(tensors)} tensors, {sum(tensors) / MiB:.0f} MiB ({sum(tensors) / 1024**3:.2f} GiB)")
    for limit in (1, 5, 16, 64):
        below = [t for t in tensors if t < limit * MiB]
        print(f"  tensors under {limit} MiB: {len(below)} ({sum(below) / MiB:.0f} MiB)")


if __name__ == "__main__":
    main()
