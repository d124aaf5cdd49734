"""Tensors as views of cached bytes: numpy arrays, or torch tensors, without a copy.

A view is built over a private mapping of the cache file
(:meth:`CachedModel.map`): the bytes are the page cache's until someone
writes to the tensor, at which point that page is copied for this process
only. The numpy array holds the mapping alive (it is the array's base), and
the torch tensor is made from the numpy array, so it holds it too: a tensor
outlives the reader that made it. Tensors of the node's RAM copy
(:mod:`weightcache.ram_copy`) are views of a read-only shared mapping:
numpy marks them not writeable, and an engine that scales one in place
must copy it first (vLLM's loaders copy every weight into its parameter).

Dtypes numpy lacks (BF16, the float8s, F4, F6) come as their raw storage in
numpy (see :mod:`weightcache.dtypes`); torch reinterprets that storage as
its real dtype in place (``Tensor.view(dtype)``), so both frameworks see the
same bytes. Converters are a registry keyed by framework name, as in
``safe_open(framework=...)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np

from kvstore.errors import InvalidArgument
from weightcache.dtypes import DTYPES, storage_shape
from weightcache.safetensors_header import TensorEntry


def numpy_tensor(entry: TensorEntry, buffer, offset: int) -> np.ndarray:
    dtype = DTYPES[entry.dtype]
    shape = storage_shape(dtype, entry.shape)
    if entry.nbytes == 0:
        return np.zeros(shape, dtype=dtype.numpy)
    return np.ndarray(shape, dtype=np.dtype(dtype.numpy), buffer=buffer, offset=offset)


def torch_tensor(entry: TensorEntry, buffer, offset: int):
    import torch

    dtype = DTYPES[entry.dtype]
    target = getattr(torch, dtype.torch, None) if dtype.torch else None
    packed = dtype.bits % 8 != 0
    shape = storage_shape(dtype, entry.shape) if packed or target is None else entry.shape
    if target is None:
        target = torch.uint8
    if entry.nbytes == 0:
        return torch.empty(shape, dtype=target)
    array = np.ndarray((entry.nbytes,), dtype=np.uint8, buffer=buffer, offset=offset)
    if not array.flags.writeable:  # the node's RAM copy, mapped read-only: torch warns, the view is what we want
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
            raw = torch.from_numpy(array)
    else:
        raw = torch.from_numpy(array)
    return raw.view(target).reshape(shape)


FRAMEWORKS: dict[str, Callable[[TensorEntry, object, int], object]] = {
    "numpy": numpy_tensor,
    "np": numpy_tensor,
    "pt": torch_tensor,
    "torch": torch_tensor,
}


def converter(framework: str) -> Callable[[TensorEntry, object, int], object]:
    try:
        make = FRAMEWORKS[framework]
    except KeyError:
        raise InvalidArgument(f"framework {framework!r}: use one of {', '.join(FRAMEWORKS)}") from None
    if make is torch_tensor:
        try:
            import torch  # noqa: F401
        except ImportError:
            raise InvalidArgument("framework 'pt' needs torch installed; use framework='numpy' without it") from None
    return make
