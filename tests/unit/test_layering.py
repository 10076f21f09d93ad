"""kiln's layers, checked statically over the source folders (ast; nothing is imported).

    kiln (contract, manifest, spec, paged_attention)  the bottom: imports no other kiln package
    runtime                                            bottom only; never torch or the build-side rooms
    corpus                                             bottom only: the calibration and evaluation text
    export -> calibration -> optimize                  the build stages, each above the ones before it;
                                                       calibration reads the corpus
    evaluation                                         measures a built engine: the corpus and the runtime,
                                                       never torch's side (export, calibration, optimize)
    heads                                              trains draft heads: the corpus, export's reference
                                                       model, calibration's layer runner, the runtime
    optimize                                           also attaches a heads artifact (kiln build --medusa)
    cli                                                the top: may import everything; nothing imports it

Inside the runtime, the policy core never imports its front ends (runtime/server/, runtime/bench/).
Stages use the runtime only through its public surface (RUNTIME_API). Every import counts,
including those inside functions: a lazy import is still a dependency, and a cycle through one
is still a cycle. (tests/unit/test_runtime_tiny_engine.py keeps a subprocess check that serving
loads no torch.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[2]

# Which kiln packages each layer may import (its own included).
ALLOWED = {
    "kiln": {"kiln"},
    "kiln.runtime": {"kiln", "kiln.runtime"},
    "kiln.corpus": {"kiln", "kiln.corpus"},
    "kiln.export": {"kiln", "kiln.export"},
    "kiln.calibration": {"kiln", "kiln.corpus", "kiln.export", "kiln.calibration"},
    "kiln.evaluation": {"kiln", "kiln.corpus", "kiln.runtime", "kiln.evaluation"},
    "kiln.heads": {"kiln", "kiln.corpus", "kiln.export", "kiln.calibration", "kiln.runtime", "kiln.heads"},
    "kiln.optimize": {"kiln", "kiln.export", "kiln.calibration", "kiln.heads", "kiln.optimize", "kiln.runtime",
                      "kiln.plugins_trt"},
    "kiln.plugins_trt": {"kiln", "kiln.runtime", "kiln.plugins_trt"},
    "kiln.cli": {"kiln", "kiln.runtime", "kiln.corpus", "kiln.export", "kiln.calibration", "kiln.evaluation",
                 "kiln.heads", "kiln.optimize", "kiln.cli"},
}
# The rooms on the build side of the house: they use the runtime only through RUNTIME_API.
BUILD_SIDE = ("kiln.corpus", "kiln.export", "kiln.calibration", "kiln.evaluation", "kiln.heads", "kiln.optimize")
RUNTIME_FRONT_ENDS = ("kiln.runtime.server", "kiln.runtime.bench", "kiln.runtime.cluster")
# What a build stage may import from the runtime: the LLM API (the package, its params), the op
# library, and the runner API that drives the engine graph (the loader opens a runner, model_runner
# has its batch types). Never the policy core (engine, scheduler, block manager, sampler, ...).
RUNTIME_API = {"kiln.runtime", "kiln.runtime.params", "kiln.runtime.ops", "kiln.runtime.loader",
               "kiln.runtime.model_runner"}
# Build-side modules allowed past RUNTIME_API, each with its reason (none today); the test fails while one is unused.
RUNTIME_INTERNALS_IN_USE: dict[str, set[str]] = {}
# Packages only the compile extra installs: nothing the runtime loads imports them.
COMPILE_ONLY = {"torch", "transformers", "safetensors", "gguf", "onnx", "onnxscript", "onnx_ir", "tqdm"}


SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def _source_modules() -> dict[str, Path]:
    """Every kiln module name -> its file, from pyproject.toml's package-dir mapping."""
    modules: dict[str, Path] = {}
    for package, folder in SETUPTOOLS["package-dir"].items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


MODULES = _source_modules()


def _resolve(name: str) -> str:
    """The kiln module an import of `name` loads: the longest prefix that is one."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(module: str) -> set[str]:
    """Every dotted name `module` imports (kiln modules resolved, third-party names as written)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from pkg import sub` imports the module pkg.sub when there is one.
            names.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                         for alias in node.names)
    return {_resolve(n) if n.split(".")[0] == "kiln" else n for n in names}


GRAPH = {module: _imports(module) for module in MODULES}


def _layer(module: str) -> str:
    """The ALLOWED key a module belongs to (its longest matching package)."""
    return max((key for key in ALLOWED if module == key or module.startswith(key + ".")), key=len)


def _edges(graph: dict[str, set[str]], predicate) -> list[str]:
    return sorted(f"{source} imports {target}" for source, targets in graph.items()
                  for target in targets if predicate(source, target))


def _against_layers(source: str, target: str) -> bool:
    return target in MODULES and _layer(target) not in ALLOWED[_layer(source)]


def _is_front_end(module: str) -> bool:
    return module.startswith(RUNTIME_FRONT_ENDS)


def _core_to_front_end(source: str, target: str) -> bool:
    return _layer(source) == "kiln.runtime" and not _is_front_end(source) and _is_front_end(target)


def _stage_to_runtime_internal(source: str, target: str) -> bool:
    return (_layer(source) in BUILD_SIDE
            and target in MODULES and _layer(target) == "kiln.runtime" and target not in RUNTIME_API)


def _runtime_closure(graph: dict[str, set[str]]) -> set[str]:
    """The runtime's modules and every kiln module they import, transitively."""
    seen = {m for m in MODULES if _layer(m) == "kiln.runtime"}
    todo = list(seen)
    while todo:
        for target in graph[todo.pop()] & MODULES.keys() - seen:
            seen.add(target)
            todo.append(target)
    return seen


def _compile_only_in_runtime(graph: dict[str, set[str]]) -> list[str]:
    closure = _runtime_closure(graph)
    return _edges(graph, lambda s, t: s in closure and t.split(".")[0] in COMPILE_ONLY)


def test_every_module_is_in_a_layer():
    assert {"kiln.contract", "kiln.cli", "kiln.runtime.engine", "kiln.runtime.server.app", "kiln.corpus",
            "kiln.corpus.windows", "kiln.evaluation.evaluate", "kiln.heads.medusa_train"} <= set(MODULES)
    assert all(_layer(module) for module in MODULES)


def test_every_package_folder_ships():
    """A folder with an __init__.py that pyproject.toml's package list lacks would be left out of the wheel."""
    folders = {module for module, path in MODULES.items() if path.name == "__init__.py"}
    assert folders == set(SETUPTOOLS["packages"])


def test_layers_import_only_what_lies_below():
    assert _edges(GRAPH, _against_layers) == []


def test_runtime_core_never_imports_its_front_ends():
    assert _edges(GRAPH, _core_to_front_end) == []


def test_stages_use_only_the_public_runtime_api():
    in_use = {source: {t for t in targets if _stage_to_runtime_internal(source, t)}
              for source, targets in GRAPH.items()}
    in_use = {source: targets for source, targets in in_use.items() if targets}
    assert in_use == RUNTIME_INTERNALS_IN_USE, "route new uses through RUNTIME_API; drop allowances no longer used"


def test_what_the_runtime_loads_imports_no_compile_only_package():
    assert _compile_only_in_runtime(GRAPH) == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm; the graph is small enough to recurse
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module] & MODULES.keys():
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or module in graph[module]:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_checks_can_fail():
    """A planted cycle, a runtime -> cli import and a torch import under the runtime are all caught."""
    planted = {module: set(targets) for module, targets in GRAPH.items()}
    planted["kiln.runtime.loader"].add("kiln.cli.commands")
    planted["kiln.cli.commands"].add("kiln.runtime.loader")
    planted["kiln.manifest"].add("torch.nn")  # the bottom layer, loaded by the runtime
    planted["kiln.runtime.engine"].add("kiln.runtime.server.app")
    planted["kiln.runtime.loader"].add("kiln.heads.medusa_heads")  # the runtime never imports a build-side room
    planted["kiln.evaluation.evaluate"].add("kiln.export.reference")  # evaluation stays on the engine's side
    planted["kiln.corpus.windows"].add("kiln.calibration.collect")  # the corpus is below calibration
    planted["kiln.heads.medusa_chat"].add("kiln.runtime.engine")  # past RUNTIME_API
    assert any({"kiln.cli.commands", "kiln.runtime.loader"} <= set(cycle) for cycle in _cycles(planted))
    assert "kiln.runtime.loader imports kiln.cli.commands" in _edges(planted, _against_layers)
    assert "kiln.manifest imports torch.nn" in _compile_only_in_runtime(planted)
    assert _edges(planted, _core_to_front_end) == ["kiln.runtime.engine imports kiln.runtime.server.app"]
    against = _edges(planted, _against_layers)
    assert {"kiln.runtime.loader imports kiln.heads.medusa_heads",
            "kiln.evaluation.evaluate imports kiln.export.reference",
            "kiln.corpus.windows imports kiln.calibration.collect"} <= set(against)
    assert "kiln.heads.medusa_chat imports kiln.runtime.engine" in _edges(planted, _stage_to_runtime_internal)
