"""The vLLM loader against vLLM's own classes (skipped where vLLM is not installed): ``--load-format
strata`` is registered, ``get_model_loader`` picks it from a real ``LoadConfig``, and its
``load_weights`` (vLLM's, over our ``get_all_weights``) fills a small module from the node cache,
with vLLM's check that every parameter was loaded."""

from __future__ import annotations

import importlib.metadata
import types

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (run with a vLLM environment's python)")
torch = pytest.importorskip("torch")

import weightcache  # noqa: E402
from kvstore.errors import InvalidArgument  # noqa: E402
from tests.support.weights_models import write_torch_model  # noqa: E402

pytestmark = pytest.mark.system


class Tiny(torch.nn.Module):
    """Shaped as vLLM models are: ``load_weights`` takes (name, tensor) pairs, returns what it loaded."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.proj = torch.nn.Linear(32, 16, dtype=torch.bfloat16)

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


def model_config(folder) -> object:
    # load_weights reads only these of vLLM's ModelConfig (a real one needs a Hugging Face config)
    return types.SimpleNamespace(model=str(folder), revision=None, quantization=None, is_moe=False,
                                 multimodal_config=None)


@pytest.fixture
def published(tmp_path):
    g = torch.Generator().manual_seed(5)
    tensors = {
        "embed.weight": torch.randn(64, 32, generator=g),
        "proj.weight": torch.randn(16, 32, generator=g).to(torch.bfloat16),
        "proj.bias": torch.randn(16, generator=g).to(torch.bfloat16),
    }
    folder = tmp_path / "model"
    write_torch_model(folder, tensors)
    (folder / "config.json").write_text("{}")
    return folder, weightcache.publish_model(str(folder), chunk_bytes=64 << 10), tensors


@pytest.fixture(autouse=True)
def vllm_config():
    """What a vLLM worker has set while it loads a model (a CPU device: no accelerator needed)."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        yield


def loader_for(extra: dict):
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    import weightcache.vllm_loader  # noqa: F401 - what the entry point does in every vLLM process

    return get_model_loader(LoadConfig(load_format="strata", model_loader_extra_config=extra))


def test_the_loader_is_registered_and_picked_by_its_load_format(tmp_path):
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    from weightcache.vllm_loader import StrataModelLoader

    loader = loader_for({"cache_dir": str(tmp_path / "c"), "enable_weights_track": True})
    assert type(loader) is StrataModelLoader and isinstance(loader, DefaultModelLoader)
    assert loader.enable_weights_track is True  # the default loader's own options still apply


def test_the_entry_point_is_declared_for_vllm_plugins():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    target = project["project"]["entry-points"]["vllm.general_plugins"]["strata_weights"]
    module, func = target.split(":")
    assert callable(getattr(importlib.import_module(module), func))


def test_options_are_checked(tmp_path):
    with pytest.raises(InvalidArgument, match="cache_dir"):
        loader_for({})
    with pytest.raises(ValueError, match="Unexpected extra config keys"):
        loader_for({"cache_dir": str(tmp_path), "no_such_option": 1})


def test_load_weights_fills_a_module_from_the_node_cache(tmp_path, published):
    folder, m, tensors = published
    loader = loader_for({"cache_dir": str(tmp_path / "cache"), "digest": m.digest})
    model = Tiny()
    loader.load_weights(model, model_config(folder))
    for name, param in model.named_parameters():
        assert torch.equal(param.data, tensors[name]), name
    # download_model leaves it warm: a second engine loads with the origin gone
    loader.download_model(model_config(folder))
    empty = tmp_path / "empty"
    empty.mkdir()
    again = Tiny()
    loader_for({"cache_dir": str(tmp_path / "cache"), "digest": m.digest, "location": str(empty)}).load_weights(
        again, model_config(folder))
    assert torch.equal(again.proj.weight.data, tensors["proj.weight"])


def test_a_missing_parameter_fails_the_load(tmp_path, published):
    folder, m, _ = published
    loader = loader_for({"cache_dir": str(tmp_path / "cache"), "digest": m.digest, "names": "embed.*"})
    with pytest.raises(ValueError, match="proj"):
        loader.load_weights(Tiny(), model_config(folder))
