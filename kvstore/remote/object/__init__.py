"""The object tier: blocks in an S3-compatible bucket, one object per block."""

from kvstore.remote.object.source import ObjectLimits, ObjectSource

__all__ = ["ObjectLimits", "ObjectSource"]
