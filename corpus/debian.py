"""Debian packages as text sources: fetched with ``apt-get download`` and unpacked with ``dpkg -x``
into a private cache, with a private sources list, so the system's apt setup is never touched.

Each unpacked package lives in ``<cache>/corpus/<package>/`` next to ``kiln-source.json`` (name,
version and sha256 of the .deb), which the corpus manifest quotes. A package already installed on
the system (its files under ``/``) is used in place, with the version dpkg reports.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEBIAN_SUITE = "deb http://deb.debian.org/debian trixie main"
SOURCE_FILE = "kiln-source.json"
INSTALL_HINT = "run `make install` or `python -m kiln.corpus --install`"


class CorpusNotFound(FileNotFoundError):
    pass


@dataclass(frozen=True)
class DebianSource:
    """One package: what to read from it (a path that proves it is unpacked) and the licence of that text."""

    package: str
    probe: str  # a file the corpus reads, relative to the package root
    licence: str

    def root(self) -> Path:
        """The directory the package's files are under (the cache, else the system)."""
        cached = cache_root() / self.package
        if self.cached():
            return cached
        if (Path("/") / self.probe).is_file():
            return Path("/")
        raise CorpusNotFound(f"the corpus source {self.package} (Debian package) is not installed in {cached}; "
                             f"{INSTALL_HINT}")

    def cached(self) -> bool:
        root = cache_root() / self.package
        return (root / self.probe).is_file() and (root / SOURCE_FILE).is_file()

    def record(self) -> dict[str, str]:
        """{package, version, deb_sha256, licence} for the corpus manifest."""
        root = self.root()
        info: dict[str, str] = {"package": self.package, "licence": self.licence}
        if root != Path("/"):
            info.update(json.loads((root / SOURCE_FILE).read_text()))
        else:
            info["version"] = _installed_version(self.package)
            info["deb_sha256"] = "system install"
        return info


def cache_root() -> Path:
    root = os.environ.get("KILN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kiln")
    return Path(root) / "corpus"


def _installed_version(package: str) -> str:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
    except FileNotFoundError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def fetch(sources: list[DebianSource]) -> list[Path]:
    """Download and unpack every source not yet in the cache (one apt-get update for all); their roots."""
    missing = [s for s in sources if not s.cached()]  # the system's copy may be another version: not used here
    if missing:
        _download([s.package for s in missing])
    return [s.root() for s in sources]


def _download(packages: list[str]) -> None:
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise CorpusNotFound(f"apt-get and dpkg are needed to fetch the Debian packages {packages}")
    with tempfile.TemporaryDirectory(prefix="kiln-apt-") as tmp:
        d = Path(tmp)
        (d / "lists" / "partial").mkdir(parents=True)
        (d / "cache" / "archives" / "partial").mkdir(parents=True)
        (d / "sources.list").write_text(DEBIAN_SUITE + "\n")
        opts = [f"-oDir::Etc::SourceList={d / 'sources.list'}", "-oDir::Etc::SourceParts=/dev/null",
                f"-oDir::State::Lists={d / 'lists'}", f"-oDir::Cache={d / 'cache'}", "-qq"]
        if os.geteuid() == 0:
            opts.append("-oAPT::Sandbox::User=root")
        print(f"kiln: fetching the corpus sources {' '.join(packages)} from the Debian archive", file=sys.stderr)
        subprocess.run(["apt-get", *opts, "update"], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["apt-get", *opts, "download", *packages], check=True, cwd=d, stdout=subprocess.DEVNULL)
        for package in packages:
            deb = sorted(d.glob(f"{package}_*.deb"))[-1]
            staging = d / "x" / package
            staging.mkdir(parents=True)
            subprocess.run(["dpkg", "-x", str(deb), str(staging)], check=True)
            version = deb.name.split("_")[1].replace("%3a", ":")
            digest = hashlib.sha256(deb.read_bytes()).hexdigest()
            (staging / SOURCE_FILE).write_text(json.dumps({"version": version, "deb_sha256": digest}))
            dest = cache_root() / package
            shutil.rmtree(dest, ignore_errors=True)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(staging, dest, symlinks=True)
