"""Compile libkiln_ops.so (the kiln.PagedAttention, kiln.MatMulQ4_1, kiln.MatMulGGUF, kiln.SwiGLU, kiln.MoE and
kiln.AllReduce ONNX Runtime CPU kernels, and the sampler's row kernels that runtime/ops/sampling.py calls through
ctypes) with g++, once per instruction set: libkiln_ops.so for AVX2 (the baseline) and libkiln_ops_avx512vnni.so
for CPUs with AVX-512 VNNI, which kiln.runtime.ops.library_path() picks at load. A whole library per ISA, not a
dispatching one, because two ISAs in one library share their inline and std:: code, and the linker may keep the
AVX-512 copy for the AVX2 path.

Standard library only: setup.py loads this file by path at install time, and `make` or a
developer can rerun it:  python runtime/ops/build_ops.py [-o OUT.so]

ONNX Runtime's C/C++ headers are in no PyPI package. They are taken from, in order:
$KILN_ORT_INCLUDE, the cache dir ~/.cache/kiln/ort-headers (or $KILN_CACHE_DIR/ort-headers),
/usr/include/onnxruntime; otherwise Debian's libonnxruntime-dev is downloaded into the cache
with a private apt sources list (the system's apt configuration is not touched).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = ("paged_attention.cc", "matmul_q4_1.cc", "matmul_gguf.cc", "matmul_gguf_int8.cc", "swiglu.cc", "moe.cc",
           "moe_q4_1.cc", "moe_gguf.cc", "sampling.cc", "rescore_logits.cc", "all_reduce.cc")
HEADERS = ("simd.h", "attention_rows.h", "paged_attention_kernel.h", "validate.h", "shape_text.h", "parallel_for.h",
           "matmul_q4_1.h", "amx_q4_1.h", "q4_1_records.h", "q4_k_records.h", "q6_k_records.h", "gguf_records.h",
           "matmul_gguf.h", "matmul_gguf_int8.h", "swiglu.h", "moe.h", "moe_experts.h", "sampling_simd.h",
           "rescore_logits.h", "all_reduce.h")
LIBRARY_NAME = "libkiln_ops.so"
# variant name -> (library file name, compiler flags added to CXXFLAGS); the first is the baseline. 256-bit vectors
# stay preferred: the kernels are written for ymm registers, VNNI only adds instructions (vpdpbusd) on them.
VARIANTS = {
    "avx2": (LIBRARY_NAME, ()),
    "avx512vnni": ("libkiln_ops_avx512vnni.so",
                   ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mprefer-vector-width=256")),
}
MARKER_HEADER = "onnxruntime_lite_custom_op.h"
DEBIAN_SUITE = "deb http://deb.debian.org/debian trixie main"
DEBIAN_PACKAGE = "libonnxruntime-dev"
CXXFLAGS = ("-std=c++17", "-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall")


class BuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("KILN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kiln")
    return Path(root) / "ort-headers"


def _header_dir(root: Path) -> Path | None:
    for candidate in (root, root / "onnxruntime", root / "usr" / "include" / "onnxruntime"):
        if (candidate / MARKER_HEADER).is_file():
            return candidate
    return None


def _apt_download(dest: Path) -> None:
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise BuildError(
            f"ONNX Runtime headers not found and apt-get/dpkg are unavailable to fetch {DEBIAN_PACKAGE}; "
            f"set KILN_ORT_INCLUDE to a directory holding {MARKER_HEADER}"
        )
    with tempfile.TemporaryDirectory(prefix="kiln-apt-") as tmp:
        d = Path(tmp)
        (d / "lists" / "partial").mkdir(parents=True)
        (d / "cache" / "archives" / "partial").mkdir(parents=True)
        (d / "sources.list").write_text(DEBIAN_SUITE + "\n")
        opts = [
            f"-oDir::Etc::SourceList={d / 'sources.list'}",
            "-oDir::Etc::SourceParts=/dev/null",
            f"-oDir::State::Lists={d / 'lists'}",
            f"-oDir::Cache={d / 'cache'}",
            "-qq",
        ]
        if os.geteuid() == 0:
            opts.append("-oAPT::Sandbox::User=root")  # the _apt user cannot write into our private dirs
        print(f"kiln: fetching {DEBIAN_PACKAGE} headers from the Debian archive", file=sys.stderr)
        try:
            subprocess.run(["apt-get", *opts, "update"], check=True, stdout=subprocess.DEVNULL)
            subprocess.run(["apt-get", *opts, "download", DEBIAN_PACKAGE], check=True, cwd=d, stdout=subprocess.DEVNULL)
            debs = sorted(d.glob(f"{DEBIAN_PACKAGE}_*.deb"))
            if not debs:
                raise BuildError(f"apt-get download {DEBIAN_PACKAGE} produced no .deb")
            staging = d / "x"
            subprocess.run(["dpkg", "-x", str(debs[-1]), str(staging)], check=True)
        except subprocess.CalledProcessError as exc:
            raise BuildError(
                f"could not download {DEBIAN_PACKAGE} ({exc}); "
                f"set KILN_ORT_INCLUDE to a directory holding {MARKER_HEADER}"
            ) from exc
        src = _header_dir(staging)
        if src is None:
            raise BuildError(f"{debs[-1].name} has no {MARKER_HEADER}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp_dest = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp_dest, ignore_errors=True)
        shutil.copytree(src, tmp_dest)
        shutil.rmtree(dest, ignore_errors=True)
        tmp_dest.rename(dest)


def find_ort_headers(fetch: bool = True) -> Path:
    """The directory holding onnxruntime_lite_custom_op.h, downloading it into the cache if needed."""
    env = os.environ.get("KILN_ORT_INCLUDE")
    if env:
        found = _header_dir(Path(env))
        if found is None:
            raise BuildError(f"KILN_ORT_INCLUDE={env} holds no {MARKER_HEADER}")
        return found
    for root in (cache_dir(), Path("/usr/include/onnxruntime")):
        found = _header_dir(root)
        if found is not None:
            return found
    if not fetch:
        raise BuildError(f"no ONNX Runtime headers in KILN_ORT_INCLUDE, {cache_dir()} or /usr/include/onnxruntime")
    _apt_download(cache_dir())
    return find_ort_headers(fetch=False)


def variant_path(output: Path, variant: str) -> Path:
    """Where `variant`'s library goes when the baseline library goes to `output` (the same folder)."""
    return Path(output).with_name(VARIANTS[variant][0]) if variant != "avx2" else Path(output)


def build(output: Path, include: Path | None = None, verbose: bool = True) -> Path:
    """Compile the op library into `output` (a .so path) and its other ISA variants next to it; returns `output`.
    The variants compile in parallel (one g++ each)."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise BuildError(f"no C++ compiler ({cxx}) on PATH: install g++ to build {LIBRARY_NAME}")
    include = include or find_ort_headers()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    jobs = []
    for variant, (_, flags) in VARIANTS.items():
        target = variant_path(output, variant)
        tmp = target.with_name(target.name + ".tmp")
        cmd = [cxx, *CXXFLAGS, *flags, f"-I{include}", f"-I{HERE}", *(str(HERE / s) for s in SOURCES), "-o", str(tmp)]
        if verbose:
            print("kiln:", " ".join(cmd), file=sys.stderr)
        jobs.append((variant, target, tmp, subprocess.Popen(cmd)))
    codes = [(variant, job.wait()) for variant, _, _, job in jobs]
    failed = [f"{variant} (exit {code})" for variant, code in codes if code != 0]
    if failed:
        for _, _, tmp, _ in jobs:
            tmp.unlink(missing_ok=True)
        raise BuildError(f"compiling {LIBRARY_NAME} failed: {', '.join(failed)}")
    for _, target, tmp, _ in jobs:
        os.replace(tmp, target)  # atomic: a loaded old library stays valid
    return output


def is_stale(output: Path) -> bool:
    newest = max((HERE / f).stat().st_mtime for f in (*SOURCES, *HEADERS))
    for variant in VARIANTS:
        path = variant_path(output, variant)
        if not path.is_file() or path.stat().st_mtime < newest:
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=f"compile {LIBRARY_NAME}")
    parser.add_argument("-o", "--output", type=Path, default=HERE / LIBRARY_NAME)
    parser.add_argument("--if-stale", action="store_true", help="only rebuild when a source is newer than the library")
    args = parser.parse_args(argv)
    if args.if_stale and not is_stale(args.output):
        return 0
    try:
        print(build(args.output))
    except BuildError as exc:
        print(f"kiln: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
