"""A command run without the extra it needs says which one to install, in one sentence (the missing
modules are simulated with a sys.meta_path blocker, tests/blocked_extras.py, not uninstalled)."""

from __future__ import annotations

import re
import subprocess
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import tomllib
from blocked_extras import command_line

from kiln.cli.extras import EXTRA_MODULES

REPO = Path(__file__).resolve().parents[2]


def _kiln_without(extras: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command_line(extras, *args), capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.parametrize("args, extra", [
    (["serve", "{dir}"], "server"),
    (["build", "default", "-o", "{dir}/engine"], "compile"),
    (["calibrate", "default", "--method", "awq", "-o", "{dir}/calib"], "compile"),
])
def test_a_plain_install_names_the_extra_a_command_needs(tmp_path, args, extra):
    """`pip install kiln` (no extras) then a command of an extra: exit 1 and one line naming that extra."""
    result = _kiln_without("compile,server", *(arg.format(dir=tmp_path) for arg in args))
    assert result.returncode == 1, result.stderr
    assert re.fullmatch(rf"Error: `kiln {args[0]}` needs kiln's {extra} extra \(\w+ is not installed\): "
                        rf"pip install 'kiln\[{extra}\]'\n", result.stderr), result.stderr
    assert not (tmp_path / "engine").exists()


def test_serving_on_replicas_without_ray_names_the_cluster_extra(tmp_path):
    result = _kiln_without("cluster", "serve", str(tmp_path), "--replicas", "2")
    assert result.returncode == 1, result.stderr
    assert result.stderr.endswith("`kiln serve` needs kiln's cluster extra (ray is not installed): "
                                  "pip install 'kiln[cluster]'\n"), result.stderr


def test_the_extras_modules_are_pyprojects():
    """EXTRA_MODULES holds the import names of exactly the distributions each extra declares."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    distributions = {module: {d.lower().replace("_", "-") for d in dists}
                     for module, dists in packages_distributions().items()}
    for extra, modules in EXTRA_MODULES.items():
        declared = {re.match(r"[A-Za-z0-9._-]+", r).group(0).lower().replace("_", "-")
                    for r in project["optional-dependencies"][extra]}
        provided = set().union(*(distributions[module] for module in modules))
        assert provided == declared, extra


def test_a_missing_module_outside_the_extras_keeps_its_traceback():
    from kiln.cli.extras import missing_extra

    assert missing_extra(ModuleNotFoundError("No module named 'kiln.nope'", name="kiln.nope"), "serve") is None
    wrapped = ImportError("kiln serve needs the server extras")
    wrapped.__cause__ = ModuleNotFoundError("No module named 'fastapi'", name="fastapi.responses")
    assert missing_extra(wrapped, "serve") == ("`kiln serve` needs kiln's server extra (fastapi is not installed): "
                                               "pip install 'kiln[server]'")
