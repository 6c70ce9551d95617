"""The C heap: large blocks go back to the OS when freed, so the memory a pass needs is not held after it.

glibc serves a block of at least M_MMAP_THRESHOLD bytes with its own mmap and unmaps it on free, but it raises that
threshold (up to 32 MiB) each time such a block is freed, so after the first pass a forward's activations come from
the heap, whose freed space stays with the process wherever a live block (a KV cache grown layer by layer) sits
above it. Measured on a random 2.5 B Llama (hidden 2560, FFN 6912) computing in fp32, one prefill from storage: 256
tokens peaked 183 MiB over the loaded model and kept 178 MiB after it; 1,024 tokens peaked 915 MiB and kept 781 MiB.
With the threshold fixed at 1 MiB (which also stops glibc moving it): 75 MiB and 0 kept, 328 MiB and 0 kept, the
KV cache of the prompt included. The memory a pass holds is then what the knobs count for it (an activation per
token of the context, profiles/knobs/memory.py), not the most any pass ever touched.

A user's MALLOC_MMAP_THRESHOLD_ wins; a C library without mallopt (musl, macOS) is left as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 1 << 20  # a decode step's blocks stay on the heap; a pass over many tokens maps its own
_done: str | None = None
_fixed = 0  # the threshold this process set


def return_large_blocks(decode_block: int = 0) -> str:
    """Fix the C heap's mmap threshold once per process, and raise it where a model's decode step allocates a block
    near it (DECODE_BLOCK: its fp32 logits, a vocabulary's worth): at least twice that block. Gemma 3's 262,144-token
    logits are 1 MiB, each a fresh mapping at a 1 MiB threshold whose 256 pages faulted in anew (the head's output,
    generate's float copy): 525 page faults a token, 160 at 2 MiB (its decode time moved within its noise on a
    2-core Xeon). Returns what was decided, in words."""
    global _done, _fixed
    wanted = max(MMAP_THRESHOLD_BYTES, 2 * decode_block)
    if _done is not None and (wanted <= _fixed or not _fixed):
        return _done
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        _done = f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}, set by the user"
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        _done = "the C library has no mallopt: its heap is left as it is"
        return _done
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, wanted) != 1:
        _done = _done or "mallopt refused a fixed mmap threshold: the heap is left as it is"
        return _done
    _fixed = wanted
    _done = (
        f"blocks of {wanted / (1 << 20):g} MiB and more are mapped and unmapped on their own (a fixed mmap threshold)"
    )
    return _done
