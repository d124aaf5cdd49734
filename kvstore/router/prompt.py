"""The token ids of a request's prompt, as the engine will see them, from the model's local tokenizer.

The router hashes the same tokens the engine caches, so it must tokenize the
way vLLM's OpenAI server does: a completion's text prompt with the
tokenizer's special tokens (``add_special_tokens`` of the request, default
true); a chat's messages rendered through the tokenizer's chat template
(``add_generation_prompt``, ``continue_final_message`` and
``chat_template_kwargs`` of the request) and then encoded without special
tokens, because the template writes them. A prompt given as token ids is
used as it is.

The template is always the model's own. A request's ``chat_template`` (its
own field, or a key of ``chat_template_kwargs``) is Jinja code from the
client; rendering it would run that code on the router, where ``{{ 1/0 }}``
was a 500 and nested ``range`` loops held a worker thread as long as the
client liked. vLLM
refuses such a request unless started with ``--trust-request-chat-template``
and drops ``chat_template`` and ``tokenize`` from ``chat_template_kwargs``
(``resolve_chat_template_kwargs``); the router drops both too and scores the
prompt as the model's template renders it: for an engine that does trust
the request's template that is a misestimate of the prefix, never an error.

A string may hold a lone surrogate (JSON ``"\ud800"``, which ``json.loads``
accepts) that no tokenizer can encode (it raised TypeError, a 500), nor
UTF-8 (a cache salt's, in the block hash). The router scores such a request
with U+FFFD in its place (:func:`encodable`), the character a UTF-8 decoder
puts where a byte sequence is broken: the prefix before it scores as it is,
and the request goes to the engine as it came, whose answer is the client's.

The tokenizer is loaded from a local directory only (``local_files_only``),
never from a hub, and tokenizing runs in a worker thread: a long prompt
would otherwise stall every other request on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path
from typing import Any

from kvstore.router.errors import BadRequest

log = logging.getLogger(__name__)

# chat_template_kwargs never passed on to apply_chat_template: a client's template code, and a flag that
# would make it return token ids where the router asks for text (vLLM drops the same two).
IGNORED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize"})
_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads makes an escaped pair one character: any left is lone


def encodable(text: str) -> str:
    """``text`` with U+FFFD for each lone surrogate: what a tokenizer, and UTF-8, can take."""
    return _SURROGATE.sub("\ufffd", text)


# Tokenizer classes whose whole behaviour is tokenizer.json's: loaded as that class directly, the one
# AutoTokenizer would build. AutoTokenizer's own import pulls torch in wherever torch is installed
# (its model registry), about 4 s of a router's start and hundreds of MB it never uses.
_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _tokenizer_class(model_dir: Path) -> str | None:
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None  # AutoTokenizer says what is wrong with the directory
    return config.get("tokenizer_class") if isinstance(config, dict) else None


def load_tokenizer(model_dir: str | Path):
    """The tokenizer of ``model_dir`` as ``transformers.AutoTokenizer`` builds it, without network access."""
    model_dir = Path(model_dir)
    try:
        if _tokenizer_class(model_dir) in _GENERIC_CLASSES and (model_dir / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast as loader
        else:
            from transformers import AutoTokenizer as loader
    except ImportError:
        raise RuntimeError("the cache-aware router needs transformers: pip install 'strata-kvcache[router]'") from None
    try:
        return loader.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as err:
        raise RuntimeError(
            f"cannot load a tokenizer from {model_dir}: {err}; give --model-dir the model's local directory "
            "(tokenizer.json and tokenizer_config.json)"
        ) from None


def _token_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(type(t) is int and t >= 0 for t in value):
        return value
    return None


def completion_prompt(body: dict[str, Any]) -> str | list[int]:
    """The first prompt of a completion request (a batch is scored on its first prompt)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    tokens = _token_list(prompt)
    if tokens is not None:
        return tokens
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str) or _token_list(first) is not None:
            return first
    raise BadRequest("'prompt' must be a string, a list of token ids (non-negative integers), or a non-empty list of either")


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("'messages' must be a non-empty list of message objects")
    return messages


class PromptTokenizer:
    def __init__(self, tokenizer, max_tokens: int) -> None:
        self._tokenizer = tokenizer
        self._max = max_tokens

    @classmethod
    def from_dir(cls, model_dir: str | Path, max_tokens: int) -> PromptTokenizer:
        return cls(load_tokenizer(model_dir), max_tokens)

    async def tokens(self, api: str, body: dict[str, Any]) -> list[int]:
        """The prompt's first ``max_tokens`` token ids; ``api`` is "completions" or "chat"."""
        if api == "completions":
            prompt = completion_prompt(body)
            if isinstance(prompt, list):
                return prompt[: self._max]
            special = body.get("add_special_tokens", True) is not False
            return await asyncio.to_thread(self._encode, prompt, special)
        return await asyncio.to_thread(self._chat, chat_messages(body), body)

    def _encode(self, text: str, special: bool) -> list[int]:
        return list(self._tokenizer(encodable(text), add_special_tokens=special)["input_ids"][: self._max])

    def _chat(self, messages: list[dict[str, Any]], body: dict[str, Any]) -> list[int]:
        kwargs = body.get("chat_template_kwargs")
        kwargs = {k: v for k, v in kwargs.items() if k not in IGNORED_TEMPLATE_KWARGS} if isinstance(kwargs, dict) else {}
        continue_final = body.get("continue_final_message") is True
        from jinja2 import TemplateError

        try:
            text = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=body.get("add_generation_prompt", True) is not False
                and not continue_final, continue_final_message=continue_final, **kwargs,
            )
        except (TemplateError, ValueError, TypeError, KeyError) as err:  # a template's raise_exception, bad fields
            raise BadRequest(f"the chat template cannot render these messages: {err}") from None
        except RecursionError:  # a template that recurses into content nested as deep as the JSON parser allows
            raise BadRequest("the chat template cannot render these messages: they nest too deeply for it") from None
        return self._encode(text, special=False)
