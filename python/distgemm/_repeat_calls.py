"""Calls seen before: the key of a call whose checks passed and whose path was settled -> what that
path ran. A repeated call is then one lookup, for the ops where the host path shows (the dense
and grouped GEMMs of a few microseconds).

- 16-bit ``gemm`` calls without scales, float8 ``gemm`` calls with per-tensor or row-wise scales
  and ``grouped_mm`` forward/dgrad calls: the binding's native tables
  (csrc/torch/repeat_calls.cpp). ``gemm(a, b, c, alpha, beta, out_dtype)``,
  ``scaled_gemm(a, b, c, alpha, beta, out_dtype, scale_a, scale_b, use_fast_accum)`` and
  ``grouped_mm(x, w, offs, out_dtype, trans_w)`` read the key off the tensors, and run the
  remembered vendor call or kernel (the result) or answer None (the full path), in one call;
  ``remember_gemm``, ``remember_scaled_gemm`` and ``remember_grouped_mm`` fill them, ``clear``
  empties them, ``sizes()`` counts their keys (gemm, grouped_mm, scaled gemm). They take exact
  ``torch.Tensor`` / ``nn.Parameter`` operands outside any torch-function mode and autograd; the
  callers check torch.compile, which must see that check.
- Float8 ``gemm`` calls with 128-block scales: `RepeatCalls`, a dict of Python runners.
"""

from __future__ import annotations

import ctypes
import sysconfig
import warnings
from typing import Callable, Hashable, Optional

from . import _settings, autotune
from ._library import _LIB_PATH

LIMIT = 4096  # keys per table before it starts again


class RepeatCalls(dict):
    """A bounded table: beyond `limit` signatures it starts again, so dynamic shapes stay bounded.
    A dict, so that the per-call truth test and `get` run in C (a Python method costs ~0.2 us on
    the H200's host); `get` of an unhashable key raises TypeError, which callers treat as a miss
    (an argument the checks will name)."""

    def __init__(self, limit: int = LIMIT):
        super().__init__()
        self._limit = limit

    def put(self, key: Optional[Hashable], run: Callable) -> None:
        if key is None:
            return
        if len(self) >= self._limit:
            self.clear()
        self[key] = run


def _native_tables() -> tuple:
    """The binding's table functions, made once (ctypes at import only: PyDLL keeps the GIL).
    A free-threaded CPython has another object header than the stable ABI they are built for:
    there every call takes the full path."""
    def miss(*args):
        return None
    without = (miss,) * 7 + (lambda: (0, 0, 0),)
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return without
    try:
        make = ctypes.PyDLL(_LIB_PATH).distgemm_repeat_calls
        make.argtypes = (ctypes.py_object, ctypes.py_object, ctypes.c_ssize_t)
        make.restype = ctypes.py_object
        return make(autotune.LAST_RAN, vars(_settings), LIMIT)
    except (AttributeError, ImportError, OSError, RuntimeError, TypeError) as e:
        # A torch whose tensor objects differ from the headers of this build: every call still
        # works, through the full path; only the repeated calls' host time is lost.
        warnings.warn(f"distgemm: repeated calls take the full path ({e}); reinstall distgemm against the "
                      "installed torch", RuntimeWarning, stacklevel=2)
        return without


(gemm, grouped_mm, scaled_gemm, remember_gemm, remember_grouped_mm, remember_scaled_gemm, clear,
 sizes) = _native_tables()
