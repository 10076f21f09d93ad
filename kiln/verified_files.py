"""Engine files checked against their sha256, remembered across loads by the file's identity.

Hashing every file on every load costs an 8B engine's start ~3 s (4.5 GB at ~1.5 GB/s), and more when the file is
not in the page cache. So a file whose device, inode, size, mtime and ctime are those recorded when its sha256
last matched is not read again. Any write to a file moves its mtime and ctime, and a copy is a new inode, so a
changed file is hashed again. Timestamps are coarse (a kernel tick), so a write in the same tick as the hash could
leave them equal: a file changed less than RACY_SECONDS before it was hashed is not remembered (git's "racily
clean" entries). Records live in $KILN_CACHE_DIR (default ~/.cache/kiln); a cache that cannot be read or written
costs only the hash. Set KILN_VERIFY_ALL_FILES=1 to hash every file regardless.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

RACY_SECONDS = 2.0
CACHE_NAME = "verified-engine-files.json"
VERIFY_ALL_ENV = "KILN_VERIFY_ALL_FILES"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def cache_path() -> Path:
    root = os.environ.get("KILN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kiln")
    return Path(root) / CACHE_NAME


def _identity(stat: os.stat_result) -> list[int]:
    return [stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _read_records() -> dict[str, list[int | str]]:
    try:
        records = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def _write_records(records: dict[str, list[int | str]]) -> None:
    path = cache_path()
    live = {name: record for name, record in records.items() if os.path.exists(name)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(live))
        os.replace(temporary, path)  # readers see the old records or the new, never half a file
    except OSError:
        pass


class FileVerifier:
    """matches(path, sha256) for the files of one load; records the newly verified ones when closed."""

    def __init__(self) -> None:
        self.verify_all = os.environ.get(VERIFY_ALL_ENV, "") not in ("", "0")
        self.records = {} if self.verify_all else _read_records()
        self.added: dict[str, list[int | str]] = {}

    def matches(self, path: Path, expected: str) -> bool:
        name = str(Path(path).resolve())
        before = os.stat(name)
        if self.records.get(name) == [*_identity(before), expected]:
            return True
        started = time.time_ns()
        if sha256_file(Path(name)) != expected:
            return False
        after = os.stat(name)
        changed = max(after.st_mtime_ns, after.st_ctime_ns)
        if _identity(after) == _identity(before) and started - changed > RACY_SECONDS * 1e9:
            self.added[name] = [*_identity(after), expected]
        return True

    def close(self) -> None:
        if self.added:
            _write_records({**_read_records(), **self.added})
