#!/usr/bin/env bash
# benchmarks/RESULTS.md's quantization table, end to end, with the default commands: calibrate (mixed corpus),
# build every engine of the table, `kiln eval` each against fp32 (16 x 512 tokens per domain),
# then benchmarks/quant_table.py. Long on a small machine: an hour or more on 2 idle cores.
#   bash benchmarks/quant_table.sh [OUT_DIR]        (default: engines/quant-table)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-engines/quant-table}
KILN=${KILN:-.venv/bin/kiln}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT/calib" "$OUT/reports"

[ -d "$OUT/calib/sq" ] || $KILN calibrate default --method smoothquant -o "$OUT/calib/sq"
[ -d "$OUT/calib/awq" ] || $KILN calibrate default --method awq -o "$OUT/calib/awq"
[ -d "$OUT/calib/awq-g32" ] || $KILN calibrate default --method awq --group-size 32 -o "$OUT/calib/awq-g32"

build() {  # NAME, then kiln build options
  local name=$1; shift
  [ -f "$OUT/$name/manifest.json" ] || $KILN build default "$@" -o "$OUT/$name"
}
# The weight schemes are compared at float32 KV (the reference's), the fp16-kv and int8-kv rows show the KV
# choice alone; `kiln build` itself defaults to float16 KV.
build fp32 --kv-dtype float32
build fp16-kv --kv-dtype float16
build int8-kv --kv-dtype int8 --calibration "$OUT/calib/sq"
build int8-weight-only --quantization int8-weight-only --kv-dtype float32
build w8a8 --quantization w8a8-smoothquant --calibration "$OUT/calib/sq" --kv-dtype float32
build rtn-g128 --quantization int4-rtn-g128 --kv-dtype float32
build awq-g128 --quantization int4-awq-g128 --calibration "$OUT/calib/awq" --kv-dtype float32
build awq-g32 --quantization int4-awq-g32 --calibration "$OUT/calib/awq-g32" --kv-dtype float32
build q4_1 --quantization int4-q4_1 --kv-dtype float32

for name in fp32 fp16-kv int8-kv int8-weight-only w8a8 rtn-g128 awq-g128 awq-g32 q4_1; do
  [ -s "$OUT/reports/$name.json" ] || $KILN eval "$OUT/$name" --reference "$OUT/fp32" > "$OUT/reports/$name.json"
done
$PY benchmarks/quant_table.py "$OUT"/reports/*.json
