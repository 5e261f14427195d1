"""Block attention kernels: one block of queries against one block of keys/values → ``(out, lse)``.

Backends (each a module with ``name``, ``available``, ``check``, ``forward``, ``backward``; the
contract is in :mod:`.base`): :mod:`.reference` (plain PyTorch, the test oracle), :mod:`.cpu_flash`
(PyTorch's CPU flash kernel), :mod:`.sdpa_cuda` (PyTorch's CUDA flash kernel), :mod:`.flash_attn`
(the flash-attn package).  :func:`kernel_for` picks one per block; :func:`merge` folds partials.
"""

from . import cpu_flash, flash_attn, reference, sdpa_cuda
from .base import BlockArgs, BlockMask, KernelUnsupported, LiveBlock, Visibility, check_shapes
from .merge import merge, merge_
from .select import BACKENDS, get_kernel, kernel_for

__all__ = [
    "BACKENDS",
    "BlockArgs",
    "BlockMask",
    "KernelUnsupported",
    "LiveBlock",
    "Visibility",
    "check_shapes",
    "cpu_flash",
    "flash_attn",
    "get_kernel",
    "kernel_for",
    "merge",
    "merge_",
    "reference",
    "sdpa_cuda",
]
