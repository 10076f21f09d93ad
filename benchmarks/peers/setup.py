"""Set up kiln's two peers for benchmarks/peers/run.py, in a scratch directory outside the repository.

    .venv/bin/python benchmarks/peers/setup.py [--dir ~/.cache/kiln/peers]

Steps (each skipped when already done; about 12 minutes on 2 cores from scratch, 10 of them compiling):
  1. a venv with onnxruntime-genai 0.18.0; torch/transformers/onnx for its model builder come from
     kiln's own venv through a .pth file (so PyPI's multi-GB CUDA torch is never pulled in);
  2. a Hugging Face checkpoint directory of kiln's default model (the SmolLM2 GGUF, read by kiln's own loader);
  3. onnxruntime-genai's int4 CPU model of that checkpoint, built by its builder (`-p int4 -e cpu`);
  4. llama.cpp's llama-bench, llama-batched-bench, llama-server and llama-quantize, built (GGML_NATIVE) from the
     tree vendored in the llama-cpp-python 0.3.36 sdist (benchmarks/scale/run.py converts with its
     convert_hf_to_gguf.py and llama-quantize).
Needs: kiln's venv with the compile extra (run it with that venv's python), cmake, ninja and a C++ compiler.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

from layout import LLAMA_CPP_PYTHON_VERSION, LLAMA_TOOLS, ORT_GENAI_VERSION, PeerLayout, default_scratch


class StepFailed(RuntimeError):
    pass


def say(msg: str) -> None:
    print(f"[peers setup] {msg}", flush=True)


def run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    """Run a command with its output in a log file; a failure names the command and the log's last lines."""
    with log.open("w") as out:
        code = subprocess.call([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
    if code:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise StepFailed(f"`{' '.join(map(str, cmd))}` exited with {code}; log {log}:\n{tail}")


def make_venv(lay: PeerLayout) -> None:
    if not lay.venv_python.exists():
        run([sys.executable, "-m", "venv", lay.venv], lay.root / "venv.log")
    # Installed before the .pth exists, so pip resolves onnxruntime-genai's own onnxruntime and numpy in this venv.
    run([lay.venv_python, "-m", "pip", "install", "-q", f"onnxruntime-genai=={ORT_GENAI_VERSION}"],
        lay.root / "pip.log")
    site = Path(run_output([lay.venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]))
    # Appended after the venv's own site-packages: the builder's torch, transformers and onnx come from kiln's venv.
    (site / "kiln-venv-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([lay.venv_python, "-c", "import onnxruntime_genai, torch, transformers, onnx"], lay.root / "venv-check.log")


def run_output(cmd: list[str]) -> str:
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True).stdout.strip()


def venv_done(lay: PeerLayout) -> bool:
    if not lay.venv_python.exists():
        return False
    probe = f"import onnxruntime_genai as og, torch; assert og.__version__ == '{ORT_GENAI_VERSION}'"
    return subprocess.run([str(lay.venv_python), "-c", probe], capture_output=True).returncode == 0


def hf_config(spec) -> dict:
    """config.json for a Llama-family spec, checked to parse back into the same spec."""
    from kiln.spec import ModelSpec

    if spec.family != "llama" or spec.rope_scaling is not None:
        raise StepFailed(f"the HF checkpoint writer handles plain llama models, not {spec.family} "
                         f"with rope scaling {spec.rope_scaling}")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position_embeddings, "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "bos_token_id": spec.bos_token_id, "eos_token_id": list(spec.eos_token_ids),
    }
    if ModelSpec.from_hf_config(config) != spec:
        raise StepFailed("the written config.json does not parse back into the GGUF's ModelSpec")
    return config


def write_hf_checkpoint(lay: PeerLayout) -> None:
    """The default GGUF as an HF directory: kiln's loader dequantizes it to float32 under HF names."""
    from safetensors.torch import save_file

    from kiln.export.checkpoint import DEFAULT_MODEL, load_checkpoint

    ckpt = load_checkpoint(DEFAULT_MODEL)
    if ckpt.tokenizer is None:
        raise StepFailed(f"{ckpt.source} carries no tokenizer")
    tmp = lay.hf_checkpoint.with_name(lay.hf_checkpoint.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(hf_config(ckpt.spec), indent=2))
    save_file({k: v.contiguous() for k, v in ckpt.weights.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp / "tokenizer.json").write_text(ckpt.tokenizer.tokenizer_json)
    (tmp / "tokenizer_config.json").write_text(json.dumps(ckpt.tokenizer.tokenizer_config, indent=2))
    tmp.rename(lay.hf_checkpoint)


def build_ort_genai_model(lay: PeerLayout) -> None:
    tmp = lay.ort_genai_model.with_name(lay.ort_genai_model.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    run([lay.venv_python, "-m", "onnxruntime_genai.models.builder", "-i", lay.hf_checkpoint, "-o", tmp,
         "-p", "int4", "-e", "cpu", "-c", lay.root / "builder-cache"], lay.root / "builder.log")
    tmp.rename(lay.ort_genai_model)


def unpack_llama_cpp(lay: PeerLayout) -> None:
    download = lay.root / "sdist"
    download.mkdir(exist_ok=True)
    run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", download,
         f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"], lay.root / "sdist.log")
    archive = next(download.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"), None)
    if archive is None:
        raise StepFailed(f"pip download left no llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz in {download}")
    with tarfile.open(archive) as tar:
        tar.extractall(download, filter="data")
    vendored = download / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
    if not (vendored / "CMakeLists.txt").is_file():
        raise StepFailed(f"{archive} holds no vendor/llama.cpp tree")
    shutil.rmtree(lay.llama_src, ignore_errors=True)
    shutil.move(vendored, lay.llama_src)
    shutil.rmtree(download / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}")


NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def build_llama_cpp(lay: PeerLayout) -> None:
    for tool in ("cmake", "ninja", "c++"):
        if shutil.which(tool) is None:
            raise StepFailed(f"{tool} is not installed (apt-get install -y cmake ninja-build g++)")
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_CUDA=OFF", "-DGGML_BLAS=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TOOLS=ON",
             "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
             "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
             # GGML_NATIVE turns on AMX where the CPU has it, and that path segfaults in llama-bench on this
             # project's Xeon machines (the kernel's tile-data permission); without it ggml uses AVX-512/VNNI.
             f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    run(["cmake", "-S", lay.llama_src, "-B", lay.llama_build, "-G", "Ninja", *flags], lay.root / "cmake.log")
    run(["cmake", "--build", lay.llama_build, "-j2", "--target", *LLAMA_TOOLS], lay.root / "llama-build.log")


def steps(lay: PeerLayout) -> list[tuple[str, Callable[[], bool], Callable[[PeerLayout], None]]]:
    """(name, is it done?, do it) in order."""
    return [
        (f"onnxruntime-genai {ORT_GENAI_VERSION} venv", lambda: venv_done(lay), make_venv),
        ("HF checkpoint of the default SmolLM2 GGUF", lambda: (lay.hf_checkpoint / "model.safetensors").is_file(),
         write_hf_checkpoint),
        ("onnxruntime-genai int4 CPU model", lambda: (lay.ort_genai_model / "genai_config.json").is_file(),
         build_ort_genai_model),
        (f"llama.cpp source (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist)",
         lambda: (lay.llama_src / "CMakeLists.txt").is_file(), unpack_llama_cpp),
        ("llama.cpp tools " + ", ".join(LLAMA_TOOLS),
         lambda: all(lay.llama_tool(t).is_file() for t in LLAMA_TOOLS), build_llama_cpp),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=default_scratch(),
                        help="scratch directory (default: $KILN_PEERS_DIR or ~/.cache/kiln/peers)")
    args = parser.parse_args()
    lay = PeerLayout(args.dir.expanduser().resolve())
    lay.root.mkdir(parents=True, exist_ok=True)
    say(f"scratch directory {lay.root}")
    for name, done, do in steps(lay):
        if done():
            say(f"{name}: done already")
            continue
        say(f"{name}: working ...")
        start = time.perf_counter()
        try:
            do(lay)
        except StepFailed as exc:
            say(f"{name}: FAILED: {exc}")
            return 1
        say(f"{name}: done in {time.perf_counter() - start:.0f} s")
    say("all peers ready; next: .venv/bin/python benchmarks/peers/run.py --kiln-engine NAME=DIR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
