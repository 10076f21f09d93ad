"""Where the peers live in the scratch directory (outside the repository), shared by setup.py and run.py."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ORT_GENAI_VERSION = "0.18.0"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # its sdist vendors the llama.cpp tree we build
LLAMA_TOOLS = ("llama-bench", "llama-batched-bench", "llama-server", "llama-quantize")  # the last: benchmarks/scale


def default_scratch() -> Path:
    return Path(os.environ.get("KILN_PEERS_DIR", Path.home() / ".cache" / "kiln" / "peers"))


@dataclass(frozen=True)
class PeerLayout:
    root: Path

    def __post_init__(self) -> None:
        if not self.root.is_absolute():
            raise ValueError(f"root must be an absolute path, got {self.root}")

    @property
    def venv(self) -> Path:
        return self.root / "ort-genai-venv"

    @property
    def venv_python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def hf_checkpoint(self) -> Path:
        return self.root / "smollm2-hf"

    @property
    def ort_genai_model(self) -> Path:
        return self.root / "ort-genai-int4-cpu"

    @property
    def llama_src(self) -> Path:
        return self.root / "llama.cpp"

    @property
    def llama_build(self) -> Path:
        return self.llama_src / "build"

    def llama_tool(self, name: str) -> Path:
        return self.llama_build / "bin" / name


def dangling_package_paths(venv: Path) -> list[str]:
    """The venv's borrowed package folders that are gone: each line of a .pth file in its site-packages naming an
    absolute folder that does not exist ("FILE.pth: FOLDER"). The peers' venvs take torch and numpy from kiln's venv
    through such a file, so a venv made beside another checkout breaks when that checkout's venv goes."""
    dangling = []
    for pth in sorted(venv.glob("lib/python3*/site-packages/*.pth")):
        for line in pth.read_text().splitlines():
            entry = line.strip()
            if entry.startswith("/") and not Path(entry).is_dir():
                dangling.append(f"{pth}: {entry}")
    return dangling
