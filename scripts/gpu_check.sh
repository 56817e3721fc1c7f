#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (CI has none; the suite skips CUDA there).
#   bash scripts/gpu_check.sh [OUTDIR]
# 1. the tests whose id names cuda (every test taking the `device` fixture, on cuda);
# 2. `qtool quantize --device cuda` writes the same bytes as `--device cpu` (codes, qparams,
#    sidecar) for per-channel, asymmetric, 4-bit group and mse-searched specs;
# 3. and so the float model dequantize gives back from each is the same;
# 4. `quantize --method gptq|awq+gptq --device cuda` writes the same bytes run after run, and
#    the model's KL against the float model (`qtool eval`) is within 10 % (+0.0005 nats) of the CPU
#    run's (GPTQ's codes may differ across devices: docs/calibration.md, "Devices").
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
dev=${METHOD_DEVICE:-cuda}  # METHOD_DEVICE=cpu tries section 4 on a machine without a GPU
for m in gptq awq+gptq; do
  n=${m/+/_}
  args=(quantize sample_weights/tiny-lm --method "$m" --tokens 2048 --ctx 128 --dtype int4
        --group-size 32 --threads 1)
  $py -m qtool "${args[@]}" --device cpu -o "$out/m.$n.cpu" >"$out/m.$n.cpu.log" 2>&1
  for k in 1 2; do
    $py -m qtool "${args[@]}" --device "$dev" -o "$out/m.$n.$dev$k" >"$out/m.$n.$dev$k.log" 2>&1
  done
  if diff -r "$out/m.$n.${dev}1" "$out/m.$n.${dev}2" >/dev/null; then
    echo "same bytes run after run on $dev: --method $m"
  else
    echo "DIFFERENT bytes run after run on $dev: --method $m"
    failed=1
  fi
  $py -m qtool eval sample_weights/tiny-lm "$out/m.$n.cpu" "$out/m.$n.${dev}1" --device cpu \
    --json >"$out/m.$n.eval.json"
  $py - "$out/m.$n.eval.json" "$m" "$dev" <<'EOF' || failed=1
import json, sys
doc = json.load(open(sys.argv[1]))
cpu, other = (c["causal"]["kl"]["mean"] for c in doc["candidates"])
ok = abs(other - cpu) <= 0.10 * cpu + 0.0005
print(f"{'' if ok else 'NOT '}within tolerance: --method {sys.argv[2]} KL on cpu {cpu:.4f}, "
      f"on {sys.argv[3]} {other:.4f}")
sys.exit(0 if ok else 1)
EOF
done
exit "${failed:-0}"
