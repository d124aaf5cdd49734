"""Strata inside other projects' extension points (LMCache's remote storage, ...).

Each module imports its host project, which is an optional dependency
(``pip install strata[lmcache]``), so nothing here is imported by
``kvstore`` itself: the host project names the module in its own config.
"""
