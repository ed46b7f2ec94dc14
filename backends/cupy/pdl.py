"""Programmatic dependent launch (PDL, sm_90+) for the CuPy launcher: ``cuLaunchKernelEx`` through ctypes.

A kernel launched with the attribute ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` may start
while the kernel before it on the stream is still running: once every CTA of that kernel has run
``griddepcontrol.launch_dependents`` or exited. It must then run ``griddepcontrol.wait`` (``common.cuh``'s
``qmla_wait_prior_grid``) before it reads what that kernel wrote. The launcher uses it for the combine after
the split kernel, which triggers nothing (its CTAs trigger as they exit; ``common.cuh`` says why): the
combine's launch is prepared while the split kernel's last CTAs run. Under stream capture the driver records
the same edge in the CUDA graph.

CuPy's ``driver`` module has no ``cuLaunchKernelEx``, so it is called from ``libcuda`` directly; the two
structures below follow ``cuda.h`` (CUDA 12.0 on), checked against it by ``tests/test_cupy_pdl.py``.
"""

from __future__ import annotations

import ctypes
import functools

#: cuda.h's ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` (a ``CUlaunchAttributeID``)
PROGRAMMATIC_STREAM_SERIALIZATION = 6
#: the compute capability from which GPUs run ``griddepcontrol``
PDL_MIN_CAPABILITY = (9, 0)
#: ``cuDriverGetVersion``'s value of the first driver whose stream capture records PDL launches (CUDA 12.3)
PDL_MIN_DRIVER = 12030


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, and a 64-byte value union (here its ints)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``: grid, block, dynamic shared memory, stream and the attribute list."""

    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


@functools.cache
def libcuda() -> tuple[object | None, int, str | None]:
    """(the CUDA driver library, its ``cuDriverGetVersion``, None) or (None, 0, why it cannot be loaded)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return None, 0, f"the CUDA driver library cannot be loaded ({e})"
    version = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None, 0, "the CUDA driver does not report its version"
    return lib, version.value, None


@functools.cache
def _driver() -> tuple[object | None, str | None]:
    """(``cuLaunchKernelEx`` with its argument types set, None) or (None, why it is missing)."""
    lib, version, why = libcuda()
    if lib is None:
        return None, why
    if version < PDL_MIN_DRIVER:
        # before 12.3 stream capture did not record programmatic edges into CUDA graphs
        return None, f"PDL needs a CUDA driver for CUDA 12.3 or later, this one reports {version}"
    fn = getattr(lib, "cuLaunchKernelEx", None)
    if fn is None:
        return None, "the CUDA driver has no cuLaunchKernelEx"
    fn.argtypes = (ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn, None


def pdl_unavailable_reason(capability: tuple[int, int] | None) -> str | None:
    """Why a launch with PDL cannot run on a GPU of ``capability`` here (None: it can)."""
    if capability is None or tuple(capability) < PDL_MIN_CAPABILITY:
        return f"PDL needs compute capability 9.0 or later, this GPU has {capability}"
    return _driver()[1]


@functools.cache
def _pdl_attribute() -> LaunchAttribute:
    attr = LaunchAttribute()
    attr.id = PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value[0] = 1
    return attr


def launch_config(grid: tuple[int, int, int], block: tuple[int, int, int], smem: int, stream: int) -> LaunchConfig:
    """A ``CUlaunchConfig`` for ``grid`` / ``block`` (three sizes each), ``smem`` bytes and stream
    handle ``stream``, with the programmatic-serialization attribute on."""
    attr = _pdl_attribute()
    return LaunchConfig(*grid, *block, smem, stream, ctypes.pointer(attr), 1)


def launch_with_pdl(function: int, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int,
                    stream: int, params: int) -> None:
    """Launch the ``CUfunction`` ``function`` with PDL on ``stream`` (a handle); ``params``: the address
    of the ``kernelParams`` array (:class:`~.kernel_args.PackedArgs`). Raises ``RuntimeError`` with the
    driver's result where the launch fails or the driver has no ``cuLaunchKernelEx``."""
    fn, why = _driver()
    if fn is None:
        raise RuntimeError(f"cannot launch with PDL: {why}")
    config = launch_config(grid, block, smem, stream)
    result = fn(ctypes.byref(config), function, params, None)
    if result != 0:
        raise RuntimeError(f"cuLaunchKernelEx with PDL failed: CUresult {result} (grid {grid}, block {block}, "
                           f"{smem} bytes of shared memory)")
