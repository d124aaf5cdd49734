"""What tests share that is not a fixture: servers the suite starts (redis, moto, peer daemons,
stand-in engines), blocks and models to store, raw frames for the fuzzers, and small waits.

Imported as ``from tests.support.<module> import <name>``; fixtures live in ``conftest.py``
files (the root one, or the folder whose tests alone use them).
"""
