"""The kiln custom-op library for ONNX Runtime CPU (kiln.PagedAttention).

`library_path()` is what a session registers:
    so = onnxruntime.SessionOptions(); so.register_custom_ops_library(library_path())
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from kiln.contract import OP_LIBRARY_ABI
from kiln.errors import KilnError

LIBRARY_NAME = "libkiln_ops.so"
_HERE = Path(__file__).resolve().parent


class OpLibraryError(KilnError, RuntimeError):
    """The op library is missing or incompatible; the message says how to fix it."""


def library_path() -> str:
    """Absolute path of libkiln_ops.so, which the install compiles next to this file."""
    path = _HERE / LIBRARY_NAME
    if not path.is_file():
        raise OpLibraryError(
            f"{path} is missing: reinstall kiln (pip install -e . / make install) or build it with "
            f"`python {_HERE / 'build_ops.py'}` (needs g++ and ONNX Runtime headers)"
        )
    return str(path)


_RUNTIME_SYMBOLS = ("kiln_sample_rows", "kiln_top_tokens")


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
