"""Images a request names by ``file://`` URL, read from the one directory the operator allows.

``kiln serve --allowed-media-path DIR`` (RuntimeConfig.allowed_media_path) lets image_url parts name files under
DIR, as vLLM's ``--allowed-local-media-path`` does; without it every file URL is refused. The URL's path is
resolved the way the kernel will open it (symlinks followed, ``..`` collapsed) and must lie inside DIR's own
resolved path, so neither ``..`` nor a symlink placed in DIR reaches beyond it. A plain path is no URL and is
refused (also as vLLM does), with the file URL it should have been. http(s) URLs stay refused elsewhere: the
server fetches nothing. Whoever can write into DIR is trusted as the operator is (a symlink swapped in between
the check and the open is caught for the file itself: it is opened without following one).

Refusals name the path the client sent, never where it resolved to: what lies outside DIR stays unknown to
clients (a missing file outside DIR is "outside", not "missing").
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import url2pathname

from kiln.errors import InvalidParamError

ALLOWED_MEDIA_FLAG = "--allowed-media-path"


def allowed_media_dir(path: str | os.PathLike[str]) -> Path:
    """The allowed directory, resolved; ValueError naming the problem when it is no directory."""
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_dir():
        raise ValueError(f"allowed_media_path {str(path)!r} is not a directory")
    return resolved


def is_file_url(url: object) -> bool:
    return isinstance(url, str) and url[:7].lower() == "file://"


def read_media_file(url: str, allowed: Path | None, param: str, max_bytes: int) -> bytes:
    """The bytes of the file a ``file://`` URL names inside ``allowed`` (None: local files are off)."""
    if allowed is None:
        raise InvalidParamError(f"{param}: reading local files is off; the server takes file:// image URLs only "
                                f"when started with {ALLOWED_MEDIA_FLAG} DIR (then for files inside DIR)", param)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise InvalidParamError(f"{param}: a file URL naming host {parts.netloc!r}; kiln reads local files only "
                                "(file:///absolute/path)", param)
    if parts.query or parts.fragment:
        raise InvalidParamError(f"{param}: a file URL with a query or fragment; percent-encode '?' and '#' in "
                                "file names", param)
    shown = url2pathname(parts.path)
    if not shown.startswith("/") or "\0" in shown:
        raise InvalidParamError(f"{param}: {url!r} is not a file URL of an absolute path", param)
    resolved = Path(shown).resolve()  # symlinks followed and '..' collapsed, as opening the path would
    if not resolved.is_relative_to(allowed.resolve()):
        raise InvalidParamError(f"{param}: {shown} is outside the allowed media directory "
                                f"({ALLOWED_MEDIA_FLAG})", param)
    try:
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise InvalidParamError(f"{param}: {shown}: no such file", param) from None
    except OSError as exc:
        raise InvalidParamError(f"{param}: {shown}: cannot be read ({exc.strerror})", param) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidParamError(f"{param}: {shown} is not a regular file", param)
        if info.st_size > max_bytes:
            raise InvalidParamError(f"{param}: the image is larger than {max_bytes / 2**20:g} MiB", param)
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(max_bytes + 1)  # one byte more: a file grown since fstat still fails the size check
    finally:
        os.close(fd)
