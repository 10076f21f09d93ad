"""The Triton kernels compiled ahead of time to PTX for sm_80 and sm_90 on this CPU (no GPU, no driver), with
their launch parameters recorded in launch.json (plugins_trt/aot.py; the TensorRT plugin embeds such PTX)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from kiln.plugins_trt.aot import is_trt_layout  # noqa: E402


def test_trt_layout_is_inputs_scalars_outputs():
    assert is_trt_layout(["ptr", "ptr", "i32", "ptr"]) and is_trt_layout(["ptr", "ptr"])
    assert not is_trt_layout(["ptr", "i32", "ptr", "i32"])  # a scalar after an output
    assert not is_trt_layout(["ptr", "fp32", "ptr"])  # TensorRT's extra arguments are int32 only


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
        # TensorRT's AOT launch: tensor inputs, int32 scalars, tensor outputs, then null for Triton's two scratch
        # pointers, which these kernels never use
        assert r["ptx_parameters"] == r["own_parameters"] + ["ptr", "ptr"] and is_trt_layout(r["own_parameters"])
        assert r["global_scratch_bytes"] == r["profile_scratch_bytes"] == 0
    single = next(r for r in records if r["kernel"] == "attention_q16_t64_s1")
    # query, pool, block tables, seq_lens, qsl, kv_scale, cos, sin | num_seqs, table stride | out: no partials
    assert single["ptx_parameters"] == ["ptr"] * 8 + ["i32"] * 2 + ["ptr"] * 3
    kv_write = next(r for r in records if r["kernel"] == "kv_write")  # ... | num_seqs, num_blocks, stride | pool
    assert kv_write["ptx_parameters"] == ["ptr"] * 9 + ["i32"] * 3 + ["ptr"] * 3
    attention = {r["arch"]: r for r in records if r["kernel"] == "attention_q16_t64_s1"}
    assert all(0 < r["shared_bytes"] <= 96 * 1024 for r in attention.values())  # the tiles staged in shared memory
