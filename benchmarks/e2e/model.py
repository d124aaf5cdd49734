"""The end-to-end benchmark's model: a Llama-architecture network with random weights, built locally.

``python -m benchmarks.e2e.model --out DIR [--size tiny|bench]`` writes a Hugging Face layout
directory (``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``)
that ``transformers`` loads with ``local_files_only=True``: nothing is fetched from a hub.

Why random weights: the benchmark measures where the KV of a prefix comes from (computed, the
engine's own cache, or the shared pool), not what the model says. A random Llama computes
exactly the same attention and MLP work per token as a trained one of its shape, and greedy
decoding is still deterministic, so "the first token with a cache hit equals the one without"
is a meaningful check of the KV bytes (the weights are drawn wider than a trained model's
initialisation so that the next token depends on the context, see ``initializer_range``).

The weights are seeded (``torch.manual_seed``) and fp32, so two builds of one size are the same
model. The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on a seeded
synthetic corpus: every byte string encodes (no unknown token) and ordinary text takes fewer
tokens than bytes. It carries a chat template in the ChatML style.

Sizes:

- ``tiny``: 2 layers, hidden 64; builds and prefills in well under a second (tests).
- ``small``: 4 layers, hidden 384, 3 KV heads (GQA); the load sweep's model: on one CPU core a
  1,200-token prefill takes about 0.4 s and a decoded token 7 ms, so prefill is three quarters of
  a cold turn's service time and the sweep's many requests fit in the run's time.
- ``bench``: 8 layers, hidden 512, 4 KV heads (GQA); on one CPU core a 4,096-token prefill
  takes seconds while the last 64 tokens over a cached 4,032-token prefix take a small
  fraction of that (the ratio is measured by :mod:`benchmarks.e2e.ttft`).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path

SEED = 1234
BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelSize:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    # Wider than Llama's 0.02: with 0.02 a random model's attention is nearly uniform and its next
    # token hardly depends on the context, so a wrong cached KV would go unnoticed by greedy output.
    initializer_range: float = 0.1


SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
    ),
    "small": ModelSize(
        vocab_size=4096, hidden_size=384, intermediate_size=1152, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=16384,
    ),
    "bench": ModelSize(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=16384,
    ),
}

_SYLLABLES = ("ka", "lo", "mi", "ne", "ra", "tu", "se", "vo", "di", "an", "or", "el", "is", "um", "pe", "ch", "th", "st")


def _corpus(seed: int, n_words: int = 60000) -> list[str]:
    """A deterministic text corpus: pseudo-words, digits and punctuation, in lines of varied length."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(2000)]
    words += "the of and to in is that for it as with was on be at by this from or have an are".split()
    lines, line = [], []
    for _ in range(n_words):
        w = rng.choice(words)
        if rng.random() < 0.05:
            w = str(rng.randint(0, 9999))
        if rng.random() < 0.08:
            w += rng.choice(",.;:?!")
        line.append(w.capitalize() if rng.random() < 0.1 else w)
        if len(line) >= rng.randint(6, 20):
            lines.append(" ".join(line))
            line = []
    lines.append(" ".join(line))
    return lines


MODEL_MARKER = "strata_e2e_model.json"  # written last: the directory is complete once it exists


def build_tokenizer(vocab_size: int, seed: int = SEED):
    """A byte-level BPE tokenizer with the special tokens first (ids 0..3)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    return tok


def build(out_dir: str | Path, size: str = "tiny", *, seed: int = SEED) -> Path:
    """Write the model directory for ``size`` into ``out_dir`` (created if needed) and return it."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}: use one of {', '.join(SIZES)}")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    spec = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer(spec.vocab_size, seed)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=EOS, chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
    )
    fast.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=tok.token_to_id(BOS), eos_token_id=tok.token_to_id(EOS), pad_token_id=tok.token_to_id(EOS),
        initializer_range=spec.initializer_range, tie_word_embeddings=False, dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / MODEL_MARKER).write_text(json.dumps({"size": size, "seed": seed}) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.e2e.model", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory to write the model into")
    p.add_argument("--size", default="tiny", choices=sorted(SIZES))
    p.add_argument("--seed", type=int, default=SEED)
    args = p.parse_args(argv)
    print(build(args.out, args.size, seed=args.seed))


if __name__ == "__main__":
    main()
