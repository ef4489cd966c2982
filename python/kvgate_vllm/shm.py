"""KV tensors in host shared memory: how a CPU-only engine (or a test harness) hands its
paged KV cache to the kvgate agent, which maps the same /dev/shm file.
"""

from __future__ import annotations

import itertools
import mmap
import os
from typing import Dict, Optional, Tuple

import torch

_counter = itertools.count()
# data_ptr of a region's start -> (path, bytes, mmap): mmaps stay referenced while tensors live.
_REGIONS: Dict[int, Tuple[str, int, mmap.mmap]] = {}


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _map(path: str, nbytes: int, shape, dtype: torch.dtype) -> torch.Tensor:
    fd = os.open(path, os.O_RDWR)
    try:
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    t = torch.frombuffer(mm, dtype=dtype, count=nbytes // _element_size(dtype)).view(*shape)
    _REGIONS[t.data_ptr()] = (path, nbytes, mm)
    return t


def shm_tensor(shape, dtype: torch.dtype, directory: str = "/dev/shm", name: Optional[str] = None) -> torch.Tensor:
    """A zeroed tensor over a new 0600 file in shared memory (removed by `unlink`)."""
    nbytes = _element_size(dtype)
    for d in shape:
        nbytes *= int(d)
    path = os.path.join(directory, name or f"kvgate-kv-{os.getpid()}-{next(_counter)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)
    return _map(path, nbytes, shape, dtype)


def attach(path: str, shape, dtype: torch.dtype) -> torch.Tensor:
    """Maps an existing shared-memory tensor file (another process's KV)."""
    nbytes = _element_size(dtype)
    for d in shape:
        nbytes *= int(d)
    return _map(path, nbytes, shape, dtype)


def describe(t: torch.Tensor) -> Optional[Dict[str, int]]:
    """{path, offset} when `t` lies inside a shared-memory region of this process, else None.
    `t` may be a strided view (vLLM's per-layer views of one allocation): its last element, not
    its element count, says where it ends."""
    p = t.data_ptr()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else -1
    end = p + (last + 1) * t.element_size()
    for start, (path, nbytes, _mm) in _REGIONS.items():
        if start <= p and end <= start + nbytes:
            return {"path": path, "offset": p - start}
    return None


def unlink(t: torch.Tensor) -> None:
    d = describe(t)
    if d is not None:
        try:
            os.unlink(d["path"])
        except FileNotFoundError:
            pass
