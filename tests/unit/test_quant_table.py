"""benchmarks/quant_table.py: RESULTS.md's per-domain quantization table from `kiln eval` reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "quant_table.py"
quant_table = load_script(SCRIPT, "quant_table")


def _report(quantization, kv_dtype, ppl, digest="d", loops=0):
    domains = list(ppl)
    return {"engine": f"e-{quantization}-{kv_dtype}", "quantization": quantization, "kv_dtype": kv_dtype,
            "text": "corpus:evaluation", "scored": "all", "perplexity": ppl, "eval_tokens": {d: 8176 for d in domains},
            "greedy_agreement": 0.9, "decode_tok_s": 50.0, "engine_mb": 122.4, "degenerate_answers": loops,
            "degenerate_in_reference_too": 1 if loops else 0, "chat": [{}] * 4,
            "corpus": {"domains": {d: {"token_sha256": digest} for d in domains}}}


def test_table_rows_deltas_and_order(tmp_path, capsys):
    fp32 = _report("none", "float32", {"prose": 40.0, "code": 10.0})
    awq = _report("int4-awq-g128", "float32", {"prose": 42.0, "code": 11.0}, loops=1)
    kv8 = _report("none", "int8", {"prose": 40.2, "code": 10.05})
    paths = []
    for i, r in enumerate((awq, kv8, fp32)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text("[kiln] progress\n" + json.dumps(r))
    quant_table.main([str(p) for p in paths])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| method | prose ppl (Δ) | code ppl (Δ) |")
    assert lines[2].startswith("| fp32 | 40.00 | 10.00 |")
    assert lines[3].startswith("| fp32, int8 KV | 40.20 (+0.5%) | 10.05 (+0.5%) |")
    assert lines[4] == "| int4 AWQ g128 | 42.00 (+5.0%) | 11.00 (+10.0%) | 0.90 | 1/4 (1) | 122 MiB | 50 |"
    assert "prose 8176, code 8176" in lines[-1]


def test_reports_on_other_windows_are_refused():
    with pytest.raises(SystemExit, match="other windows"):
        quant_table.table([_report("none", "float32", {"prose": 40.0}),
                           _report("int4-q4_1", "float32", {"prose": 40.1}, digest="x")])
    with pytest.raises(SystemExit, match="exactly one fp32"):
        quant_table.table([_report("int4-q4_1", "float32", {"prose": 40.1})])


def test_an_empty_report_file_is_named(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("")
    with pytest.raises(SystemExit, match="empty.json holds no"):
        quant_table.main([str(empty)])
