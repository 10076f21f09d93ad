"""The optional halves of kiln (pyproject's extras) by the modules they bring, so that a command run
without its extra says which one to install instead of a ModuleNotFoundError traceback."""

from __future__ import annotations

# Import names of each extra's distributions (tests/unit/test_extras.py keeps this equal to pyproject).
EXTRA_MODULES: dict[str, frozenset[str]] = {
    "compile": frozenset({"torch", "onnx", "onnx_ir", "onnxscript", "safetensors", "gguf", "transformers", "tqdm"}),
    "server": frozenset({"fastapi", "starlette", "pydantic", "anyio", "uvicorn", "prometheus_client", "httpx"}),
    "cluster": frozenset({"ray"}),
    "vision": frozenset({"PIL"}),
}


def missing_extra(exc: ImportError, command: str | None) -> str | None:
    """One sentence naming the extra to install when exc (or an error it was raised from, as
    runtime/server/app.py re-raises) is a module of an extra that is not installed; else None."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ModuleNotFoundError):
            module = (cause.name or "").split(".")[0]
            for extra, modules in EXTRA_MODULES.items():
                if module in modules:
                    what = f"`kiln {command}`" if command else "this kiln command"
                    return f"{what} needs kiln's {extra} extra ({module} is not installed): pip install 'kiln[{extra}]'"
        cause = cause.__cause__ or cause.__context__
    return None
