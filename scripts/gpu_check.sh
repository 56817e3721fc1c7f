#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (CI has none; the suite skips CUDA there).
#   bash scripts/gpu_check.sh [OUTDIR]
# 1. the tests whose id names cuda (every test taking the `device` fixture, on cuda);
# 2. `qtool quantize --device cuda` writes the same bytes as `--device cpu` (codes, qparams,
#    sidecar) for per-channel, asymmetric, 4-bit group and mse-searched specs;
# 3. and so the float model dequantize gives back from each is the same.
# Run it from the repository root with qtool importable (a venv, or PYTHONPATH=.).
set -euo pipefail
out=${1:-$(mktemp -d)}
mkdir -p "$out"
py=${PYTHON:-python3}

$py -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())'

# shellcheck disable=SC2086  # extra pytest options, e.g. PYTEST_ARGS="-n 8"
if ! $py -m pytest tests -q -p no:cacheprovider -p no:benchmark -k cuda ${PYTEST_ARGS:-} >"$out/pytest.log" 2>&1; then
  failed=1
fi
tail -25 "$out/pytest.log"

specs=(
  "--scheme sym --per-channel"
  "--scheme asym --per-channel"
  "--dtype int4 --group-size 32"
  "--dtype uint4 --scheme asym --group-size 16 --range mse"
)
for i in "${!specs[@]}"; do
  for dev in cpu cuda; do
    # shellcheck disable=SC2086  # the spec is a list of options
    $py -m qtool quantize sample_weights/tiny-llama -o "$out/q$i.$dev" --device "$dev" ${specs[$i]} \
      --json >"$out/q$i.$dev.json"
    $py -m qtool dequantize "$out/q$i.$dev" -o "$out/d$i.$dev" >/dev/null
  done
  if diff -r "$out/q$i.cpu" "$out/q$i.cuda" >/dev/null && diff -r "$out/d$i.cpu" "$out/d$i.cuda" >/dev/null; then
    echo "same bytes on cpu and cuda: ${specs[$i]}"
  else
    echo "DIFFERENT bytes on cpu and cuda: ${specs[$i]}"
    diff -r "$out/q$i.cpu" "$out/q$i.cuda" || true
    failed=1
  fi
done
exit "${failed:-0}"
