"""Strata's weight pipeline: publish a model revision once, stream it onto every node.

``weightcache`` imports ``kvstore``; ``kvstore`` never imports ``weightcache``.
"""
