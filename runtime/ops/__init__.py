"""The kiln custom-op library for ONNX Runtime CPU (kiln.PagedAttention, kiln.MatMulQ4_1, kiln.SwiGLU, the sampler).

`library_path()` is what a session registers:
    so = onnxruntime.SessionOptions(); so.register_custom_ops_library(library_path())

The install compiles one library per instruction set (build_ops.VARIANTS): AVX2, the baseline, and AVX-512 VNNI,
whose kiln.MatMulQ4_1 also runs many-row calls on AMX tiles where the CPU has them. `library_path()` takes the best
path this CPU runs; KILN_OPS_ISA=avx2|avx512vnni|amx chooses one (an A/B benchmark, a test of each), and naming one
the CPU lacks is an error, not an illegal instruction later.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from kiln.contract import OP_LIBRARY_ABI
from kiln.errors import KilnError
from kiln.runtime.ops.build_ops import VARIANTS

_HERE = Path(__file__).resolve().parent
ISA_ENV = "KILN_OPS_ISA"
_VNNI = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
# kernel path -> (the build_ops.VARIANTS library it loads, the /proc/cpuinfo flags it needs), best first. "amx" is
# the AVX-512 VNNI library with its AMX tiles allowed (they also need Linux's grant, asked at first use: see
# amx_q4_1.h); naming "avx512vnni" keeps that library on its vpdpbusd tiles.
_PATHS = {
    "amx": ("avx512vnni", _VNNI | {"amx_tile", "amx_int8"}),
    "avx512vnni": ("avx512vnni", _VNNI),
    "avx2": ("avx2", frozenset({"avx2", "fma", "f16c"})),
}
LIBRARY_VARIANTS = {name: (VARIANTS[library][0], needs) for name, (library, needs) in _PATHS.items()}


def library_build(variant: str) -> str:
    """The build_ops.VARIANTS library a kernel path loads (its kiln_ops_isa())."""
    return _PATHS[variant][0]


class OpLibraryError(KilnError, RuntimeError):
    """The op library is missing or incompatible; the message says how to fix it."""


def cpuinfo_field(key: str, cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The value of the first CPU's `key` line in /proc/cpuinfo (e.g. "flags", "model name"), or None where
    there is no such file or line."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                name, sep, value = line.partition(":")
                if sep and name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The CPU's feature flags as Linux reports them (only those the OS enabled), or None where unknown."""
    flags = cpuinfo_field("flags", cpuinfo)
    return None if flags is None else frozenset(flags.split())


def supported_variants(flags: frozenset[str] | None) -> list[str]:
    """The library variants a CPU with these flags runs, best first; unknown flags: the baseline only."""
    if flags is None:
        return ["avx2"]
    return [name for name, (_, needs) in LIBRARY_VARIANTS.items() if needs <= flags] or ["avx2"]


def library_variant(flags: frozenset[str] | None = None) -> str:
    """The variant library_path() loads: $KILN_OPS_ISA if set, else the best this CPU runs."""
    flags = cpu_flags() if flags is None else flags
    runnable = supported_variants(flags)
    chosen = os.environ.get(ISA_ENV, "").strip().lower()
    if not chosen or chosen == "auto":
        return runnable[0]
    if chosen not in LIBRARY_VARIANTS:
        raise OpLibraryError(f"{ISA_ENV}={chosen!r} is not a library variant; choose one of "
                             f"{', '.join(['auto', *LIBRARY_VARIANTS])}")
    if chosen not in runnable:
        raise OpLibraryError(f"{ISA_ENV}={chosen}: this CPU lacks "
                             f"{', '.join(sorted(LIBRARY_VARIANTS[chosen][1] - (flags or frozenset())))}")
    return chosen


def library_path(variant: str | None = None) -> str:
    """Absolute path of the op library for `variant` (default: library_variant()), which the install compiles
    next to this file."""
    path = _HERE / LIBRARY_VARIANTS[variant or library_variant()][0]
    if not path.is_file():
        raise OpLibraryError(
            f"{path} is missing: reinstall kiln (pip install -e . / make install) or build it with "
            f"`python {_HERE / 'build_ops.py'}` (needs g++ and ONNX Runtime headers)"
        )
    return str(path)


_RUNTIME_SYMBOLS = ("kiln_sample_rows_on_threads", "kiln_top_tokens")


def check_abi() -> int:
    """Load the library and check its ABI version against kiln.contract.OP_LIBRARY_ABI; returns it."""
    path = library_path()
    try:
        lib = ctypes.CDLL(path)
        found = int(lib.kiln_ops_abi_version())
    except (OSError, AttributeError) as exc:
        raise OpLibraryError(f"{path} cannot be loaded as a kiln op library ({exc}); rebuild it") from exc
    rebuild = f"rebuild it with `python {_HERE / 'build_ops.py'}`"
    if found != OP_LIBRARY_ABI:
        raise OpLibraryError(f"{path} implements op-library ABI {found} but this kiln expects ABI {OP_LIBRARY_ABI}; "
                             f"{rebuild}")
    # The sampler's C routines are not ORT ops (the engines' ABI does not cover them): a library built before
    # them is refused here, at load, not at the first sampled step.
    missing = [name for name in _RUNTIME_SYMBOLS if not hasattr(lib, name)]
    if missing:
        raise OpLibraryError(f"{path} lacks {', '.join(missing)} (built before them); {rebuild}")
    return found
