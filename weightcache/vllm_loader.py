"""vLLM's ``--load-format strata``: a model's weights streamed through the node cache.

::

    vllm serve /models/llama --load-format strata \\
        --model-loader-extra-config '{"location": "s3://models/llama/rev1", "digest": "…",
                                      "cache_dir": "/var/cache/strata/weights"}'

:class:`StrataModelLoader` subclasses vLLM's ``DefaultModelLoader`` and
changes only where the weights come from: ``get_all_weights`` yields
``(name, tensor)`` from :func:`weightcache.open_model` (torch tensors that
are views of verified bytes in the node cache, each as soon as its chunks
are here), so vLLM's own ``load_weights`` — the model's ``load_weights``,
the check that every parameter was loaded — runs unchanged.
``download_model`` fills the node cache without building the model.
``model`` (the engine's ``--model``) still names the folder vLLM reads the
config and tokenizer from; the weights' ``location`` defaults to it.

It registers itself on import (``@register_model_loader("strata")``), and
the ``vllm.general_plugins`` entry point (:func:`register`) imports it in
every vLLM process. The options of ``--model-loader-extra-config`` are
taken out before the default loader checks the rest, so its own options
(``enable_weights_track``) still work beside them.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, fields

from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from kvstore.errors import InvalidArgument
from weightcache.fetch import FetchLimits


@dataclass(frozen=True)
class StrataLoadOptions:
    cache_dir: str  # the node cache (shared by every engine on the node)
    location: str | None = None  # where the revision is published [default: the engine's --model]
    digest: str | None = None  # the manifest to load [default: the location's latest]
    revision: str | None = None
    cache_bytes: int | None = None
    files: str | None = None  # a glob: only these safetensors files (one rank's shards)
    names: str | None = None  # a glob: only these tensors
    concurrency: int = 8  # chunks in flight
    deadline_s: float | None = None  # fail the load if the weights are not here by then
    ram_dir: str | None = None  # the weight node's host-RAM copy (--ram-dir): one copy for every rank

    @classmethod
    def take(cls, extra: dict) -> tuple[StrataLoadOptions, dict]:
        """(our options, the keys left for the default loader)."""
        ours = {f.name for f in fields(cls)}
        mine = {k: v for k, v in extra.items() if k in ours}
        if "cache_dir" not in mine:
            raise InvalidArgument(
                "--load-format strata needs cache_dir in --model-loader-extra-config, e.g. "
                '\'{"cache_dir": "/var/cache/strata/weights", "location": "s3://bucket/model/rev"}\''
            )
        try:
            return cls(**mine), {k: v for k, v in extra.items() if k not in ours}
        except TypeError as err:
            raise InvalidArgument(f"--model-loader-extra-config: {err}") from None


@register_model_loader("strata")
class StrataModelLoader(DefaultModelLoader):
    def __init__(self, load_config) -> None:
        extra = load_config.model_loader_extra_config
        if not isinstance(extra, dict):
            raise InvalidArgument(f"--model-loader-extra-config must be a JSON object for strata, got {type(extra).__name__}")
        self.options, rest = StrataLoadOptions.take(extra)
        load_config.model_loader_extra_config = rest
        try:
            super().__init__(load_config)
        finally:
            load_config.model_loader_extra_config = extra

    def _open(self, model_config, **kw):
        from weightcache.reader import open_model

        o = self.options
        limits = FetchLimits(max_in_flight=o.concurrency, origin_concurrency=o.concurrency)
        return open_model(
            o.location or model_config.model, o.digest, cache_dir=o.cache_dir, cache_bytes=o.cache_bytes,
            revision=o.revision, files=o.files, names=o.names, limits=limits, deadline_s=o.deadline_s,
            ram_dir=o.ram_dir, **kw,
        )

    def download_model(self, model_config) -> None:
        with self._open(model_config, include="*") as reader:
            reader.wait()

    def get_all_weights(self, model_config, model) -> Generator[tuple[str, object], None, None]:
        import time

        if self.counter_before_loading_weights == 0.0:
            self.counter_before_loading_weights = time.perf_counter()
        with self._open(model_config, framework="pt") as reader:
            yield from reader
            reader.wait()  # a chunk that failed fails the load, after every other tensor was given


def register() -> None:
    """The ``vllm.general_plugins`` entry point: importing this module registered the loader."""
