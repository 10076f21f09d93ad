"""benchmarks/RESULTS.md's quantization table from `kiln eval` reports: perplexity per domain and its change vs fp32.

    kiln eval ENGINE --reference FP32_ENGINE > reports/NAME.json     (one per engine, fp32 included)
    python benchmarks/quant_table.py reports/*.json

The fp32 row is the report whose engine has no quantization and a float32 KV cache. Every report must
have been measured on the same windows (the corpus manifests' token digests are compared).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_SCHEMES = {"none": "fp32", "int8-weight-only": "int8 weight-only", "w8a8-smoothquant": "W8A8 SmoothQuant",
            "int4-q4_1": "int4 Q4_1 (exact GGUF weights)"}
_ORDER = ("none", "int8-weight-only", "w8a8-smoothquant", "int4-rtn-g128", "int4-awq-g128", "int4-awq-g32",
          "int4-q4_1")


def label(report: dict) -> str:
    scheme = report["quantization"]
    name = _SCHEMES.get(scheme) or scheme.replace("int4-rtn-", "int4 RTN ").replace("int4-awq-", "int4 AWQ ")
    return name if report["kv_dtype"] == "float32" else f"{name}, {report['kv_dtype'].replace('float', 'fp')} KV"


def _digests(report: dict) -> dict[str, str]:
    return {d: m["token_sha256"] for d, m in report["corpus"]["domains"].items()}


def table(reports: list[dict]) -> str:
    fp32 = [r for r in reports if r["quantization"] == "none" and r["kv_dtype"] == "float32"]
    if len(fp32) != 1:
        raise SystemExit("quant_table: give exactly one fp32 report (no quantization, float32 KV)")
    base = fp32[0]
    domains = list(base["perplexity"])
    for r in reports:
        if _digests(r) != _digests(base):
            raise SystemExit(f"quant_table: {r['engine']} was measured on other windows than {base['engine']}")

    def order(r: dict) -> tuple[int, str]:
        scheme = r["quantization"]
        return (_ORDER.index(scheme) if scheme in _ORDER else len(_ORDER), r["kv_dtype"] != "float32", label(r))

    head = ["method", *(f"{d} ppl (Δ)" for d in domains), "greedy agreement", "looping chat answers (fp32 loops too)",
            "engine size", "decode tok/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(reports, key=order):
        cells = [label(r)]
        for d in domains:
            ppl = r["perplexity"][d]
            cells.append(f"{ppl:.2f}" if r is base else f"{ppl:.2f} ({100 * (ppl / base['perplexity'][d] - 1):+.1f}%)")
        agreement = r["greedy_agreement"]
        cells.append("—" if agreement is None else f"{agreement:.2f}")
        loops, too = r["degenerate_answers"], r["degenerate_in_reference_too"]
        cells.append(f"{loops}/{len(r['chat'])}" + (f" ({too})" if loops and too is not None else ""))
        cells.append(f"{r['engine_mb']:.0f} MiB")
        cells.append(f"{r['decode_tok_s']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    tokens = ", ".join(f"{d} {n}" for d, n in base["eval_tokens"].items())
    return "\n".join(lines) + f"\n\npredicted tokens per domain: {tokens} ({base['text']})\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="`kiln eval` JSON reports")
    args = parser.parse_args(argv)
    reports = []
    for path in args.reports:
        text = path.read_text()
        if "{" not in text:
            raise SystemExit(f"quant_table: {path} holds no `kiln eval` report")
        reports.append(json.loads(text[text.index("{"):]))
    sys.stdout.write(table(reports))


if __name__ == "__main__":
    main()
