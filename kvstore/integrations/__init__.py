"""Strata inside other projects' extension points: LMCache's remote storage
(:mod:`.lmcache`), a secondary tier of vLLM's own KV offloading (:mod:`.vllm`),
an L3 storage backend of SGLang's hierarchical cache (:mod:`.sglang`).

Each package imports its host project, which is an optional dependency
(``pip install strata-kvcache[lmcache]``, ``[vllm]``, ``[sglang]``), so nothing here is imported
by ``kvstore`` itself: the host project names the module in its own config.
:mod:`.health` (when a daemon is worth calling) is shared and imports neither.
"""
