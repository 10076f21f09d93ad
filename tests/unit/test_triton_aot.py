"""The Triton kernels compiled ahead of time to PTX for sm_80 and sm_90 on this CPU (no GPU, no driver), with
their launch parameters recorded in launch.json (plugins_trt/aot.py; the TensorRT plugin embeds such PTX)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_ptx_for_sm80_and_sm90_with_launch_parameters(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    subprocess.run([sys.executable, "-m", "kiln.plugins_trt.aot", "-o", str(tmp_path / "ptx"), "--arch", "80",
                    "--arch", "90"], check=True, env=env, capture_output=True, timeout=600)
    records = json.loads((tmp_path / "ptx" / "launch.json").read_text())["kernels"]
    kernels = {"kv_write", "attention_q16_t64_s1", "attention_q4_t64_s1", "attention_q4_t64_s8", "merge_s8"}
    assert {(r["kernel"], r["arch"]) for r in records} == {(k, a) for k in kernels for a in ("sm_80", "sm_90")}
    for r in records:
        ptx = (tmp_path / "ptx" / f"{r['kernel']}.{r['arch']}.ptx").read_text()
        assert f".target {r['arch']}" in ptx and f".entry {r['entry']}(" in ptx
        assert r["threads"] == 32 * r["num_warps"] and r["num_warps"] in (1, 4)
        assert r["ptx_parameters"] >= r["own_parameters"]  # Triton's scratch pointers come after the kernel's own
    attention = {r["arch"]: r for r in records if r["kernel"] == "attention_q16_t64_s1"}
    assert all(0 < r["shared_bytes"] <= 96 * 1024 for r in attention.values())  # the tiles staged in shared memory
