"""How many thread-block clusters of a kernel a GPU runs at once: the driver's ``cuOccupancyMaxActiveClusters``.

A kernel declared with ``__cluster_dims__`` launches its CTAs in clusters that the GPU places on one GPC each, so
a grid that fits the SMs as single CTAs may not fit them as clusters (a GPC of 18 SMs holds two clusters of 8, not
two and a quarter). The launcher asks before it plans v6's merging clusters (:func:`~.plans.v6_merge_reason`).
CuPy's ``driver`` module has no such call, so it is called from ``libcuda`` (:func:`~.pdl.libcuda`) with
:class:`~.pdl.LaunchConfig`.
"""

from __future__ import annotations

import ctypes
import functools
import threading

from .pdl import LaunchConfig, libcuda

_LOCK = threading.Lock()
_ACTIVE: dict[tuple, int | None] = {}


@functools.cache
def _occupancy_call():
    """``cuOccupancyMaxActiveClusters`` with its argument types set, or None where the driver lacks it."""
    lib, _version, _why = libcuda()
    fn = getattr(lib, "cuOccupancyMaxActiveClusters", None) if lib is not None else None
    if fn is not None:
        fn.argtypes = (ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(LaunchConfig))
        fn.restype = ctypes.c_int
    return fn


def max_active_clusters(function: int, cluster: tuple[int, int, int], threads: int, smem: int, device_index: int
                        ) -> int | None:
    """Clusters of the ``CUfunction`` ``function`` (declared with the compile-time cluster shape ``cluster``;
    ``threads`` per CTA, ``smem`` dynamic shared bytes) that device ``device_index`` runs at once, cached; None
    where the driver cannot say (no such call, or it fails)."""
    key = (function, cluster, threads, smem, device_index)
    if key in _ACTIVE:
        return _ACTIVE[key]
    call = _occupancy_call()
    got = None
    if call is not None:
        import cupy

        config = LaunchConfig(*cluster, threads, 1, 1, smem, None, None, 0)
        count = ctypes.c_int(0)
        with cupy.cuda.Device(device_index):
            if call(ctypes.byref(count), function, ctypes.byref(config)) == 0:
                got = count.value
    with _LOCK:
        _ACTIVE[key] = got
    return got
