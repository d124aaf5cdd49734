"""Strata's test suite, laid out like the packages it tests (``tests/<area>/test_*.py``).

A package so that ``tests.support`` is importable by that name from the repository root: the
environment may hold another top-level ``tests`` package (cufile-python, an lmcache dependency,
installs one), and a regular package on an earlier ``sys.path`` entry is found first. The test
folders themselves have no ``__init__.py``: pytest imports each test module by its basename,
so basenames are unique across the tree (``tests/meta/test_layout.py`` checks).
"""
