"""Regenerate the GGUF fixtures in this folder with llama.cpp's own tools (nothing of llama.cpp is copied here).

    .venv/bin/python tests/data/gguf/make_fixtures.py --llama-cpp ~/.cache/kiln/peers/llama.cpp

Each fixture is a tiny random-weight Hugging Face model of a supported family (tests/helpers.py's
make_tiny_hf_model: the real config's keys, layers and width shrunk, the tiny byte-level BPE tokenizer),
converted by the tree's ``convert_hf_to_gguf.py`` to the listed outtype and, for a few, quantized by its
``llama-quantize`` from an f32 conversion. fixtures.json records, per file, the family, overrides and seed the
model came from, how it was made, the sha256, and the llama.cpp commit and package versions that made it;
tests/golden/test_real_gguf.py reads it.

The llama.cpp tree: the one benchmarks/peers/setup.py unpacks from the llama-cpp-python sdist and builds
(``llama-quantize`` under build/bin). One thing is set around the converter: its BPE pre-tokenizer check
identifies a tokenizer by the hash of its token ids on a test string, and the tiny tokenizer's vocabulary is
in no table, so ``get_vocab_base_pre`` is answered "gpt-2" -- what the tiny tokenizer is (ByteLevel with
GPT-2's split regex). Everything else (tensor names, order, types, metadata, vocabulary) is the converter's.
Phi fixtures name GPT2Tokenizer in tokenizer_config.json, as Phi-4-mini does (Phi-3's converter otherwise wants a
SentencePiece tokenizer.model). Gemma 2's converter reads nothing but a SentencePiece tokenizer.model, so its
fixture's tokenizer is one trained here (SENTENCEPIECE_CORPUS, BPE with byte fallback, the model's vocabulary
size). The converter imports sentencepiece even for BPE tokenizers: `pip install sentencepiece` into the venv that
runs this script (or a --target folder on PYTHONPATH).

LLaVA-1.5 as llama.cpp splits it (fixtures.json's "vision" entries; tests/engine/test_vision_mmproj.py): the tiny
random LLaVA of tests/vision_fixtures.py, its text part converted by convert_hf_to_gguf.py (``llava-f32.gguf``, the
``<image>`` token in its vocabulary) and its image side by the documented LLaVA-1.5 path (docs/multimodal/llava.md):
``tools/mtmd/legacy-models/llava_surgery_v2.py`` takes the projector out into ``llava.projector``, the tower goes
into a CLIP vision-model directory (the surgery's ``llava.clip`` step: CLIPVisionModel's ``vision_model.*`` names
and the LLaVA's vision_config), and ``convert_image_encoder_to_gguf.py --clip-model-is-vision --llava-projector
--use-f32`` writes ``mmproj-llava-f32.gguf`` (the patch convolution and the projector's matrices in f16 whatever
--use-f32 says, as the script does). That script needs llama.cpp's pinned transformers (its
tools/mtmd/requirements.txt: 4.57.6; transformers 5's CLIPVisionModel has no ``vision_model``): pass a directory it
is installed in with ``--legacy-transformers`` (``pip install --target DIR transformers==4.57.6``, then remove
DIR's numpy so the venv's is used).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent.parent
sys.path.insert(0, str(TESTS))

# name -> (family, overrides of make_tiny_hf_model, outtype of the converter, llama-quantize type or None)
FIXTURES: dict[str, tuple[str, dict, str, str | None]] = {
    "llama-f32": ("llama", {}, "f32", None),
    "llama-q8_0": ("llama", {"num_key_value_heads": 1}, "q8_0", None),
    "mistral-f16": ("mistral", {}, "f16", None),
    "qwen2-f16": ("qwen2", {}, "f16", None),
    "qwen3-f32": ("qwen3", {"tie_word_embeddings": False}, "f32", None),
    "phi3-f32": ("phi3", {}, "f32", None),
    "phi4-f32": ("phi4", {}, "f32", None),
    "gemma2-f32": ("gemma2", {}, "f32", None),
    "gemma3-q8_0": ("gemma3", {"head_dim": 128, "query_pre_attn_scalar": 128}, "q8_0", None),
    "mixtral-f32": ("mixtral", {"intermediate_size": 32}, "f32", None),
    "qwen2_moe-f32": ("qwen2_moe", {"num_experts": 8}, "f32", None),
    "qwen3_moe-f32": ("qwen3_moe", {"num_experts": 8}, "f32", None),
    "olmoe-f32": ("olmoe", {"num_experts": 8}, "f32", None),
    # k-quant rows need K % 256 == 0: hidden 256 and intermediate 512, so Q4_K_M's Q4_K / Q6_K mix is what it
    # is on real models; at hidden 64 llama-quantize falls back per tensor (Q5_0, Q8_0 ...), also as it does.
    "llama256-q4_k_m": ("llama", {"hidden_size": 256, "intermediate_size": 512}, "f32", "Q4_K_M"),
    "llama256-q4_0": ("llama", {"hidden_size": 256, "intermediate_size": 512}, "f32", "Q4_0"),
    "qwen2-256-q4_k_m": ("qwen2", {"hidden_size": 256, "intermediate_size": 512, "tie_word_embeddings": False},
                         "f32", "Q4_K_M"),
    "llama-q4_k_m": ("llama", {}, "f32", "Q4_K_M"),
}
SEED = 0
SENTENCEPIECE_FAMILIES = {"gemma2"}  # converters that read only a SentencePiece tokenizer.model
# Few distinct characters: with byte fallback (256 pieces) and 3 specials, a 320-token vocabulary leaves 61 pieces
# for the characters and their merges.
SENTENCEPIECE_CORPUS = "\n".join([
    "the cat sat on the mat and the dog sat on the log",
    "a model reads the text and writes the next word",
    "paged attention keeps the keys and values in blocks",
    "the engine runs the graph on the cores it has",
] * 8)
VISION = ("llava-f32", "mmproj-llava-f32")  # the text GGUF and the mmproj of the tiny LLaVA-1.5


def _converter_runner(tree: Path) -> str:
    """Python that runs the tree's convert_hf_to_gguf.py as __main__ once per job (argv lists as JSON on stdin),
    in one process (its imports once), with the pre-tokenizer named."""
    return (
        "import json, runpy, sys\n"
        f"sys.path.insert(0, {str(tree)!r})\n"
        "import conversion.base as base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'\n"
        "for argv in json.load(sys.stdin):\n"
        f"    sys.argv = [{str(tree / 'convert_hf_to_gguf.py')!r}, *argv]\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )


def convert_all(tree: Path, jobs: list[tuple[Path, Path, str]]) -> None:
    """(HF dir, out file, outtype) each, by the tree's converter."""
    argvs = [[str(hf_dir), "--outfile", str(out), "--outtype", outtype] for hf_dir, out, outtype in jobs]
    _run([sys.executable, "-c", _converter_runner(tree)], stdin=json.dumps(argvs))


def _as_phi4_tokenizer(hf_dir: Path) -> None:
    """The converter reads Phi-3's SentencePiece tokenizer.model unless tokenizer_config names GPT2Tokenizer, as
    Phi-4-mini's does: the tiny byte-level BPE tokenizer is that kind."""
    config_path = hf_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "GPT2Tokenizer"
    config_path.write_text(json.dumps(config, indent=2))


def _as_sentencepiece_tokenizer(hf_dir: Path) -> None:
    """Replace the tiny BPE tokenizer by a SentencePiece one of the model's vocabulary size, unk/bos/eos at the tiny
    tokenizer's ids 0-2, trained on SENTENCEPIECE_CORPUS (one thread: the same model every run)."""
    import sentencepiece as spm

    vocab_size = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    corpus = hf_dir / "corpus.txt"
    corpus.write_text(SENTENCEPIECE_CORPUS)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(hf_dir / "tokenizer"), vocab_size=vocab_size,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1,
                                   eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    for leftover in (corpus, hf_dir / "tokenizer.vocab", hf_dir / "tokenizer.json"):
        leftover.unlink()
    config = {"tokenizer_class": "GemmaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "pad_token": None, "add_bos_token": False, "add_eos_token": False, "model_max_length": 512}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def make_llava_pair(tree: Path, legacy_transformers: Path, scratch: Path) -> dict[str, dict]:
    """VISION's two files from the tiny LLaVA (seed SEED), by the tree's converters; their fixtures.json entries."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from vision_fixtures import make_tiny_llava

    source = make_tiny_llava(scratch / "llava-source", seed=SEED)
    text, mmproj = (HERE / f"{name}.gguf" for name in VISION)
    convert_all(tree, [(source, text, "f32")])
    _run([sys.executable, str(tree / "tools/mtmd/legacy-models/llava_surgery_v2.py"), "-m", str(source)])
    vit = scratch / "vit"
    vit.mkdir()
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        tower = {"vision_model." + k.removeprefix("vision_tower."): f.get_tensor(k) for k in f.keys()
                 if k.startswith("vision_tower.")}
    save_file(tower, str(vit / "model.safetensors"), metadata={"format": "pt"})
    vision_config = json.loads((source / "config.json").read_text())["vision_config"]
    (vit / "config.json").write_text(json.dumps({**vision_config, "architectures": ["CLIPVisionModel"]}, indent=2))
    out = scratch / "mmproj"
    env = {**os.environ, "PYTHONPATH": f"{legacy_transformers}:{tree / 'gguf-py'}"}
    done = subprocess.run([sys.executable, str(tree / "tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py"),
                           "-m", str(vit), "--llava-projector", str(source / "llava.projector"), "--output-dir",
                           str(out), "--clip-model-is-vision", "--use-f32"], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"convert_image_encoder_to_gguf.py failed:\n{done.stderr[-3000:]}")
    (out / "mmproj-model-f32.gguf").replace(mmproj)
    sys.path.insert(0, str(TESTS.parent / "benchmarks" / "peers"))
    from layout import LLAMA_CPP_PYTHON_VERSION

    how = {"text": "convert_hf_to_gguf.py --outtype f32",
           "mmproj": "llava_surgery_v2.py, then convert_image_encoder_to_gguf.py --clip-model-is-vision "
                     "--llava-projector --use-f32 under transformers 4.57.6"}
    return {name: {"family": "llava", "source": "tests/vision_fixtures.py make_tiny_llava", "seed": SEED,
                   "llama_cpp": f"the tree vendored in the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist",
                   "made_by": how["mmproj" if name.startswith("mmproj") else "text"], "bytes": path.stat().st_size,
                   "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
            for name, path in zip(VISION, (text, mmproj), strict=True)}


def quantize(tool: Path, source: Path, out: Path, kind: str) -> None:
    _run([str(tool), str(source), str(out), kind, "1"])


def _run(cmd: list[str], stdin: str | None = None) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, input=stdin)
    if done.returncode:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise SystemExit(f"{cmd[0]} failed:\n{tail}")


def llama_cpp_commit(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%H %cs"], capture_output=True, text=True)
    if done.returncode or not done.stdout.strip():
        raise SystemExit(f"{tree} is not a git checkout of llama.cpp (its commit goes into fixtures.json)")
    return done.stdout.strip()


def versions() -> dict[str, str]:
    import gguf  # noqa: F401  (the converter uses the tree's own gguf-py; recorded for the reader)
    import tokenizers
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", type=Path, default=Path.home() / ".cache" / "kiln" / "peers" / "llama.cpp",
                        help="llama.cpp source tree with build/bin/llama-quantize (benchmarks/peers/setup.py)")
    parser.add_argument("--only", nargs="*", help="fixture names to remake (default: all; llava-f32 and "
                        "mmproj-llava-f32 go together)")
    parser.add_argument("--legacy-transformers", type=Path, default=None,
                        help="a directory with transformers 4.57.6 installed (pip install --target), for llama.cpp's "
                             "legacy mmproj converter; without it the LLaVA pair is not remade")
    args = parser.parse_args()
    from helpers import make_tiny_hf_model

    tree = args.llama_cpp.expanduser().resolve()
    tool = tree / "build" / "bin" / "llama-quantize"
    wanted = [name for name in FIXTURES if not args.only or name in args.only]
    vision = args.legacy_transformers is not None and (not args.only or bool(set(VISION) & set(args.only)))
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{tree} lacks convert_hf_to_gguf.py; run benchmarks/peers/setup.py (or pass --llama-cpp)")
    if any(FIXTURES[name][3] for name in wanted) and not tool.is_file():
        raise SystemExit(f"{tool} is not built; run benchmarks/peers/setup.py (or pass --llama-cpp)")
    index_path = HERE / "fixtures.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else {"fixtures": {}}
    if wanted:  # the LLaVA pair records its tree in its own entries
        index.update(llama_cpp=llama_cpp_commit(tree), versions=versions(),
                     made_by="tests/data/gguf/make_fixtures.py")
    with tempfile.TemporaryDirectory() as scratch:
        if vision:
            index.setdefault("vision", {}).update(make_llava_pair(tree, args.legacy_transformers.resolve(),
                                                                  Path(scratch)))
            for name in VISION:
                print(f"{name}: {index['vision'][name]['bytes'] / 1024:.0f} KiB", flush=True)
        jobs, outs = [], {}
        for name in wanted:
            family, overrides, outtype, kind = FIXTURES[name]
            hf_dir = make_tiny_hf_model(Path(scratch) / name, family, seed=SEED, **overrides)
            if family.startswith("phi"):
                _as_phi4_tokenizer(hf_dir)
            if family in SENTENCEPIECE_FAMILIES:
                _as_sentencepiece_tokenizer(hf_dir)
            outs[name] = HERE / f"{name}.gguf"
            jobs.append((hf_dir, outs[name] if kind is None else Path(scratch) / f"{name}.{outtype}.gguf", outtype))
        if jobs:
            convert_all(tree, jobs)
        for (_, converted, _), name in zip(jobs, wanted, strict=True):
            family, overrides, outtype, kind = FIXTURES[name]
            if kind is not None:
                quantize(tool, converted, outs[name], kind)
            out = outs[name]
            index["fixtures"][name] = {"family": family, "overrides": overrides, "seed": SEED, "outtype": outtype,
                                       "quantized": kind, "bytes": out.stat().st_size,
                                       "sha256": hashlib.sha256(out.read_bytes()).hexdigest()}
            print(f"{name}: {out.stat().st_size / 1024:.0f} KiB", flush=True)
    index["fixtures"] = dict(sorted(index["fixtures"].items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
