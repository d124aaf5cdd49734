"""The model and its forward passes: a Hugging Face causal LM on torch CPU, greedy or sampled.

KV moves between the model's ``DynamicCache`` and the engine's caches as one tensor shaped
``[layers, 2, kv_heads, tokens, head_dim]`` (:func:`kv_of`, :func:`cache_of`). The cache object
is built fresh per request from that tensor (``DynamicCache(ddp_cache_data=...)``, present
across the transformers releases the engine supports) rather than cropped in place, whose API
changed between releases.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from benchmarks.e2e.kv_layout import KVLayout, model_digest

log = logging.getLogger(__name__)


def kv_of(cache: DynamicCache) -> torch.Tensor:
    """All layers' K and V of ``cache`` (batch 1) as one new tensor."""
    return torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers])


def cache_of(kv: torch.Tensor | None) -> DynamicCache:
    if kv is None or kv.shape[3] == 0:
        return DynamicCache()
    return DynamicCache(ddp_cache_data=[(kv[i, 0].unsqueeze(0), kv[i, 1].unsqueeze(0)) for i in range(kv.shape[0])])


@dataclass(frozen=True)
class PublishedModel:
    """A model revision published with ``strata weights publish``, streamed through the node's weight cache."""

    location: str  # s3://bucket/prefix (or a local folder)
    digest: str  # the manifest's digest (what publish printed)
    cache_dir: str  # the node cache (shared with the node's ``strata weights serve``)
    s3_endpoint: str = ""  # an S3-compatible endpoint; http:// is allowed (a private test server)
    s3_region: str = "us-east-1"


def load_published(model: PublishedModel) -> tuple[Path, dict[str, torch.Tensor]]:
    """Every tensor of ``model`` through :func:`weightcache.open_model` (each verified chunk by chunk; a
    warm node cache reads nothing from the origin), and the cached folder of its other files."""
    from weightcache import open_model
    from weightcache.origin import S3OriginOptions

    s3 = None
    if model.location.startswith("s3://"):
        s3 = S3OriginOptions(endpoint=model.s3_endpoint or None, region=model.s3_region,
                             allow_http=model.s3_endpoint.startswith("http://"))
    with open_model(model.location, model.digest, cache_dir=model.cache_dir, framework="pt", s3=s3,
                    include=lambda path: not path.endswith(".safetensors")) as reader:
        tensors = dict(reader)
        folder = reader.path("config.json").parent
    return folder, tensors


class ModelRunner:
    """Loads ``model_dir`` (local files only), or a :class:`PublishedModel` through the weight cache, and
    runs one sequence at a time."""

    def __init__(self, model_dir: str | Path, block_size: int, threads: int | None = None, *,
                 published: PublishedModel | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        tensors = None
        if published is not None:
            model_dir, tensors = load_published(published)
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"{self.model_dir} has no config.json: build one with python -m benchmarks.e2e.model --out DIR"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        if tensors is None:
            self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, local_files_only=True,
                                                              dtype=torch.float32)
        else:
            config = AutoConfig.from_pretrained(self.model_dir, local_files_only=True)
            self.model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            self.model.load_state_dict(tensors, strict=True)  # copies: the views of the cache can go
            del tensors
        self.model.eval()
        params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5.2x
        cfg = self.model.config
        self.max_model_len = int(cfg.max_position_embeddings)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, block_size,
                               model_digest(self.model_dir))
        self.eos_token_ids = self._stop_ids()

    def _stop_ids(self) -> frozenset[int]:
        ids = set()
        eos = self.model.config.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        for special in ("<|im_end|>", "<|end_of_text|>"):
            tid = self.tokenizer.convert_tokens_to_ids(special)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return frozenset(ids)

    @torch.inference_mode()
    def forward(self, token_ids: list[int], cache: DynamicCache) -> torch.Tensor:
        """Run ``token_ids`` after what ``cache`` holds (it grows); the last position's logits."""
        out = self.model(
            input_ids=torch.tensor([token_ids], dtype=torch.long), use_cache=True, logits_to_keep=1,
            **{self._cache_arg: cache},
        )
        return out.logits[0, -1]

    @staticmethod
    def pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
        if temperature <= 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def chat_prompt(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
