"""NeMo 2.x's ``MegatronCheckpointIO`` keeping ``s3://`` URLs as text: ``S3MegatronCheckpointIO``.

The NeMo 2.x half of `s3_mcore` (docs/megatron.md has the recipe); users reach it as
``s3_mcore.megatron_checkpoint_io_class()``. NeMo's class turns an ``s3://`` URL into a ``pathlib.Path``
(``s3:/bucket/...``) and makes local directories for it; the class built here saves and loads ``<url>/weights`` with
`s3_mcore.S3TorchDistSaveShardedStrategy` and megatron-core's own load, through `s3_mcore`'s routing (the memory tier
too, from ``s3_writer_options={"memory_tier": ...}``: saves replicate to the next node by themselves in a job of
several nodes, and every rank agrees where it reads each file before a load). NeMo and megatron-core are imported on
first use.

Package-internal (docs/api.md): `megatron_checkpoint_io_class` and `nemo_checkpoint_url` are `s3_mcore`'s names.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

if __package__:
    from . import s3_dcp as _dcp
    from . import s3_dirpath_utils as _urls
    from . import s3_mcore as _mc
    from . import s3_process as _process
    from . import s3_utils as _s3
else:  # installed (or copied) as top-level modules
    import s3_dcp as _dcp
    import s3_dirpath_utils as _urls
    import s3_mcore as _mc
    import s3_process as _process
    import s3_utils as _s3

__all__: list[str] = []  # users reach it through s3_mcore.megatron_checkpoint_io_class

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------------------
# NeMo 2.x's layout
# --------------------------------------------------------------------------------------------------------------------

WEIGHTS_SUBDIR = "weights"
"""NeMo 2.x keeps the distributed checkpoint in ``<checkpoint>/weights`` (``ckpt_to_weights_subdir``)."""


def nemo_checkpoint_url(path: Any) -> str | None:
    """The ``s3://`` URL of the NeMo 2.x checkpoint directory `path` names (text, Path or collapsed Path), without the
    ``.ckpt`` suffix Lightning gives checkpoint names (as NeMo's ``ckpt_to_dir``); None if it is not ``s3://``.
    Package-internal (docs/api.md): users call `s3_mcore.nemo_checkpoint_url`."""
    url = _mc.megatron_s3_url(path)
    return url.removesuffix(".ckpt") if url is not None else None


class _S3MegatronCheckpointIOMixin:
    """The ``s3://`` half of `megatron_checkpoint_io_class`: NeMo's ``MegatronCheckpointIO`` turns the URL into a
    ``pathlib.Path`` (``s3:/bucket/...``) and makes local directories for it; these methods keep it a URL."""

    def __init__(self, *args: Any, s3_writer_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.s3_writer_options = dict(s3_writer_options or {})
        connection = {k: v for k, v in self.s3_writer_options.items() if k in _mc.CONNECTION_ARGUMENTS}
        _mc.install_s3_routing(  # loads go to the store the saves go to, and read the tier too
            _s3.S3Utils.from_arguments(**connection) if connection else None,
            memory_tier=self.s3_writer_options.get("memory_tier"),
        )

    @property
    def s3_save_sharded_strategy(self) -> Any:
        """`S3TorchDistSaveShardedStrategy`, inside ``FullyParallelSaveStrategyWrapper`` when NeMo's
        ``parallel_save`` is on (its default), as NeMo builds its own."""
        cached = self.__dict__.get("_s3_save_strategy")
        if cached is None:
            options = dict(self.s3_writer_options)
            multiproc = getattr(self, "torch_dist_multiproc", None)  # NeMo's thread_count for torch_dist
            if multiproc is not None:
                options.setdefault("thread_count", multiproc)
            cached = _mc.save_strategy_class()(**options)
            if getattr(self, "parallel_save", False):
                fully_parallel = _mc.megatron_core("dist_checkpointing.strategies.fully_parallel")
                within_dp = getattr(self, "parallel_save_within_dp", False)
                group = _data_parallel_group() if within_dp else None
                constant = bool(getattr(self, "assume_constant_structure", False))
                cached = fully_parallel.FullyParallelSaveStrategyWrapper(cached, group, constant)
            self.__dict__["_s3_save_strategy"] = cached
        return cached

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> Any:
        """As NeMo's, for ``s3://``: saves to ``<url>/weights``; returns megatron-core's ``AsyncRequest`` when
        ``async_save`` is on (for NeMo's ``AsyncFinalizableCheckpointIO``), else None."""
        url = nemo_checkpoint_url(path)
        if url is None:
            return super().save_checkpoint(checkpoint, path, storage_options)  # type: ignore[misc]
        weights = url if url.endswith("/" + WEIGHTS_SUBDIR) else _urls.join_s3_url(url, WEIGHTS_SUBDIR)
        if _tiered():  # every file this save commits in memory also goes to the next node
            _mc.replicate_by_default()
        serialization = _mc.megatron_core("dist_checkpointing.serialization")
        kwargs: dict[str, Any] = {}
        content_metadata = (storage_options or {}).get("content_metadata")
        if content_metadata is not None:
            kwargs["content_metadata"] = content_metadata
        constant = getattr(self, "assume_constant_structure", False)
        validate = not (getattr(self, "validated_consistency", False) and constant)
        self.validated_consistency = True
        asynchronous = bool(getattr(self, "async_save", False))
        request = serialization.save(
            sharded_state_dict=checkpoint,
            checkpoint_dir=weights,
            sharded_strategy=self.s3_save_sharded_strategy,
            validate_access_integrity=validate,
            async_sharded_save=asynchronous,
            **kwargs,
        )
        logger.info("Saved the distributed checkpoint %s%s", weights, " (upload scheduled)" if asynchronous else "")
        return request if asynchronous else None

    def load_checkpoint(
        self, path: Any, sharded_state_dict: Any = None, map_location: Any = None, strict: Any = None
    ) -> dict[str, Any]:
        """As NeMo's, for ``s3://``: loads ``<url>/weights`` when it exists (NeMo 2.x's layout), else ``<url>``.
        `strict` as NeMo takes it (what ``MegatronStrategy`` passes: ``strict_loading`` or ``ckpt_load_strictness``):
        a bool (False drops the keys the checkpoint lacks first), a ``StrictHandling`` or its text, or None."""
        url = nemo_checkpoint_url(path)
        if url is None:
            return super().load_checkpoint(  # type: ignore[misc]
                path, sharded_state_dict=sharded_state_dict, map_location=map_location, strict=strict
            )
        if map_location is not None:
            raise ValueError("map_location is not supported for distributed checkpoints (as in NeMo's checkpoint IO)")
        if sharded_state_dict is None:
            raise ValueError("a distributed checkpoint needs the model's sharded_state_dict to load")
        checkpoint_dir = _nemo_weights_to_load(url)
        serialization = _mc.megatron_core("dist_checkpointing.serialization")
        strict_handling = _mc.megatron_core("dist_checkpointing.validation").StrictHandling
        if isinstance(strict, bool):  # NeMo's translation (megatron-core takes no bool)
            if not strict and hasattr(self, "adjust_non_strict_load"):
                sharded_state_dict = self.adjust_non_strict_load(checkpoint_dir, sharded_state_dict)
            strict = strict_handling.ASSUME_OK_UNEXPECTED if strict else strict_handling.LOG_ALL
        if strict is None:
            strict = strict_handling.ASSUME_OK_UNEXPECTED
        strategy = None
        if getattr(self, "parallel_load", False):  # NeMo's ckpt_parallel_load (megatron-core's wrapper needs CUDA)
            fully_parallel = _mc.megatron_core("dist_checkpointing.strategies.fully_parallel")
            base_strategy = _mc.megatron_core("dist_checkpointing.strategies.torch").TorchDistLoadShardedStrategy()
            strategy = fully_parallel.FullyParallelLoadStrategyWrapper(base_strategy, _data_parallel_group())
        loaded = serialization.load(sharded_state_dict, checkpoint_dir, sharded_strategy=strategy, strict=strict)
        return _to_current_cuda_device(loaded)

    def remove_checkpoint(self, path: Any) -> None:
        """Removes every object under the checkpoint's prefix (``.metadata`` first, so it never looks complete)."""
        url = nemo_checkpoint_url(path)
        if url is None:
            return super().remove_checkpoint(path)  # type: ignore[misc]
        s3 = _nemo_s3()
        active = _mc.routing()
        if active is not None and active.memory_tier is not None:  # this node's copies, their drains skipped
            active.remove_from_tier(url)
        weights = _urls.join_s3_url(url, WEIGHTS_SUBDIR)
        markers = (_urls.join_s3_url(weights, _dcp.METADATA_NAME), _urls.join_s3_url(url, _dcp.METADATA_NAME))
        for marker in markers:
            if s3.s3_path_exists(marker):
                s3.remove_object(marker)
        s3.remove_objects_with_prefix(url)
        return None

    def teardown(self) -> None:
        """Lightning's end of the run: with the memory tier, `finish_drains` (Lightning's wrappers, NeMo's
        ``AsyncFinalizableCheckpointIO`` among them, do not pass this on: call `finish_drains` yourself there)."""
        _mc.finish_drains()
        parent = getattr(super(), "teardown", None)
        if parent is not None:
            parent()


def _nemo_s3() -> _s3.S3Utils:
    """How the NeMo checkpoint IO reaches S3: the installed routing's `S3Utils`, else the default one."""
    return _mc.routing().s3 if _mc.routing() is not None else _s3.S3Utils()


def _tiered() -> bool:
    active = _mc.routing()
    return active is not None and active.memory_tier is not None


def _nemo_weights_to_load(url: str) -> str:
    """``<url>/weights`` when it holds megatron-core's ``metadata.json`` (NeMo 2.x's layout), else `url` if it does;
    FileNotFoundError (as NeMo's) if neither does. With the memory tier, every rank first agrees on ``<url>/weights``
    alone (`s3_mcore.agree_to_load`, replication started first): taken where every rank can load it whole from some
    tier, which the load then reads each file from; else only what S3 holds counts, alike on every rank."""
    active = _mc.routing()
    exists = active.exists if active is not None else _nemo_s3().s3_path_exists  # the memory tier too
    weights = url if url.endswith("/" + WEIGHTS_SUBDIR) else _urls.join_s3_url(url, WEIGHTS_SUBDIR)
    if _tiered():  # collective: NeMo loads (and asks for the content metadata) on every rank
        _mc.replicate_by_default()
        if _mc.agree_to_load(weights):
            return weights
        exists = _nemo_s3().s3_path_exists  # what some rank's node alone holds does not count
    for candidate in dict.fromkeys((weights, url)):
        if exists(_urls.join_s3_url(candidate, _mc.CONFIG_NAME)):
            return candidate
    config = _mc.CONFIG_NAME
    raise FileNotFoundError(f"Checkpoint file not found: {url} (no {config} in it or in its {WEIGHTS_SUBDIR}/)")


def _data_parallel_group() -> Any:
    """megatron-core's data-parallel group (with context parallelism), as NeMo passes to the fully-parallel
    wrappers; None (the whole world) where megatron-core's model parallelism is not initialised."""
    parallel_state = _mc.megatron_core("parallel_state")
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def _to_current_cuda_device(checkpoint: Any) -> Any:
    """NeMo's ``_fix_tensors_device`` after a load: CUDA tensors on another device move to the current one. A no-op
    where CUDA is not initialised (NeMo's asserts instead, so its own load cannot run on CPU)."""
    torch = _process.import_optional_dependency("torch", "megatron-core checkpoints")
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return checkpoint
    current = torch.device("cuda", index=torch.cuda.current_device())

    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_cuda and value.device != current:
            return value.to(current)
        return value

    return _mc.megatron_core("dist_checkpointing.dict_utils").dict_list_map_outplace(move, checkpoint)


def megatron_checkpoint_io_class(base: type | None = None) -> type:
    """NeMo 2.x's ``MegatronCheckpointIO`` (or `base`) with ``s3://`` support: ``S3MegatronCheckpointIO``.

    Built on NeMo's class (``nemo.lightning.io.pl.MegatronCheckpointIO``), so it is what NeMo's
    ``AsyncFinalizableCheckpointIO`` accepts. It takes NeMo's arguments plus ``s3_writer_options`` (keyword
    arguments for `s3_dcp.S3StorageWriter`), installs `install_s3_routing`, and for ``s3://`` paths saves and loads
    ``<url>/weights`` with `S3TorchDistSaveShardedStrategy` (other paths go to NeMo's code). `base` is for other
    frameworks with NeMo's interface (and tests without NeMo). Package-internal (docs/api.md): users call
    `s3_mcore.megatron_checkpoint_io_class`."""
    if base is None:
        base = _nemo_megatron_checkpoint_io()
    return _checkpoint_io_class(base)


def _content_metadata_loader(base: type) -> Callable[..., Any]:
    original = getattr(base, "load_content_metadata", None)

    def load_content_metadata(path: Any = None, preloaded_state_dict: Any = None) -> Any:
        """As NeMo's (``MegatronStrategy.load_checkpoint`` calls it before every load), for ``s3://``: the content
        metadata saved in ``<url>/weights`` (or ``<url>``), NeMo's default where the checkpoint has none. NeMo's
        own looks for ``weights/`` on local disk and fails on an ``s3://`` checkpoint."""
        url = nemo_checkpoint_url(path)
        serialization = _mc.megatron_core("dist_checkpointing.serialization")
        if url is not None and preloaded_state_dict is None:
            preloaded_state_dict = serialization.load_common_state_dict(_nemo_weights_to_load(url))
            path = None
        if original is None:  # a base without NeMo's method
            return serialization.load_content_metadata(path, preloaded_state_dict=preloaded_state_dict)
        return original(path, preloaded_state_dict=preloaded_state_dict)

    return load_content_metadata


@functools.cache
def _checkpoint_io_class(base: type) -> type:
    namespace = {
        "__module__": __name__,
        "__qualname__": "S3MegatronCheckpointIO",
        "__doc__": _S3MegatronCheckpointIOMixin.__doc__,
        "load_content_metadata": staticmethod(_content_metadata_loader(base)),
    }
    return type("S3MegatronCheckpointIO", (_S3MegatronCheckpointIOMixin, base), namespace)


def _nemo_megatron_checkpoint_io() -> type:
    try:
        return importlib.import_module("nemo.lightning.io.pl").MegatronCheckpointIO
    except ImportError as exc:
        raise _s3.MissingOptionalDependencyError(
            f"S3MegatronCheckpointIO builds on NeMo 2.x's MegatronCheckpointIO, which could not be imported ({exc}). "
            "Install nemo-toolkit 2.x (with the megatron-core it pins), or use S3TorchDistSaveShardedStrategy with "
            "megatron-core directly.",
            name="nemo",
        ) from exc
