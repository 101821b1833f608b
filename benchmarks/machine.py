"""What a benchmark ran on, in one line: the CPU, its vector extensions, NumPy's BLAS and
kernels, and how busy the machine was (timings on shared cores move with the load).

    from machine import cpu_model, describe
    print(describe())   # CPU: AMD EPYC (avx2, avx512f), 2 cores; OpenBLAS 0.3.31 Haswell ...
"""

from __future__ import annotations

import os
import platform


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def vector_flags() -> list[str]:
    """The CPU's AVX flags that decide which kernels NumPy and OpenBLAS pick."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return [f for f in ("avx", "avx2", "fma", "avx512f", "avx512bw") if f in flags]
    except OSError:
        pass
    return []


def blas() -> str:
    """NumPy's BLAS and the kernels it picked (OpenBLAS's `architecture`: Haswell is its
    AVX2 kernels; OPENBLAS_CORETYPE=Haswell forces them on an AVX-512 CPU)."""
    import numpy  # noqa: F401 - loads the BLAS that threadpoolctl then finds

    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "BLAS unknown"
    pinned = os.environ.get("OPENBLAS_CORETYPE")
    for pool in threadpool_info():
        if pool.get("user_api") == "blas":
            return (f"{pool.get('internal_api')} {pool.get('version')} "
                    f"{pool.get('architecture', '')} kernels"
                    + (f" (chosen by OPENBLAS_CORETYPE={pinned} in the environment)"
                       if pinned else "")).strip()
    return "no BLAS found"


def numpy_simd() -> str:
    """The SIMD levels NumPy's own loops dispatch to (NPY_DISABLE_CPU_FEATURES narrows
    them, e.g. to emulate an AVX2 machine's)."""
    import numpy as np

    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:
        return ""
    found = [name for name in ("AVX2", "AVX512F", "AVX512_SKX", "X86_V3", "X86_V4")
             if features.get(name)]
    return f"NumPy {np.__version__} loops up to {found[-1] if found else 'baseline'}"


def load() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load unknown"
    return f"load average {one:.1f} (5 min {five:.1f})"


def describe() -> str:
    """One line: CPU, flags, cores, BLAS, NumPy's SIMD level, Python, load."""
    flags = ", ".join(vector_flags()) or "no AVX"
    return (f"CPU: {cpu_model()} ({flags}), {os.cpu_count()} cores; {blas()}; "
            f"{numpy_simd()}; Python {platform.python_version()}; {load()}")
