#!/usr/bin/env bash
# Issue 12's GPU figures as one short script: per-step cost of both paper workloads on the GPU against the
# same GPU's plain float32 and float64 steps, where that time goes, and whether the CPU's compiled kernels
# fall back to eager ops under the GPU machine's torch (each part under its own time limit).
#
#   bash bench/gpu_speed.sh OUT_DIR [SHARED_DIR]
#
# With the device tool (as bench/gpu_check.sh says: shared/data in the checkout, the zstandard wheel in .whl/):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 && timeout 560 bash bench/gpu_speed.sh $OUT shared
#   > $OUT/log.txt 2>&1
# OUT_DIR gets env.txt, bench.md (bench/bench_engine.py), profile.md (bench/profile_engine.py --device cuda),
# compiled-cpu.txt (the compiled CPU engine's warnings under this torch).
set -u
out=${1:?usage: bash bench/gpu_speed.sh OUT_DIR [SHARED_DIR]}
shared=${2:-../shared}
py=${PYTHON:-python3}
mkdir -p "$out"
t0=$(date +%s)
stamp() { echo "== $(( $(date +%s) - t0 )) s: $*"; }

stamp environment
{ nvidia-smi -L 2>/dev/null; lscpu | grep -m1 'Model name'; nproc
  "$py" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"; } 2>&1 \
  | tee "$out/env.txt"

stamp "bench/bench_engine.py on the GPU: both paper workloads in one process"
timeout 200 "$py" bench/bench_engine.py --device cuda --workloads resnet18,gpt2-117m --steps 2 \
  --shared "$shared/data" --out "$out/bench.md" 2>&1 | tail -8

stamp "bench/profile_engine.py on the GPU: where a verified step's time goes"
timeout 170 "$py" bench/profile_engine.py --device cuda --workloads gpt2-117m,resnet18 --steps 2 --no-write \
  --shared "$shared/data" --section "GPU" > "$out/profile.md" 2>&1
tail -14 "$out/profile.md"

# torch before 2.13 shared one recompile budget among generated functions (fixed by fused.define's linecache
# entries): a CPU run whose every sizeable output takes a compiled kernel must print no fallback warning, nor
# the compiler check's (fused.compiled_code_rounds: under torch 2.11 on the H200 machine's Xeon, session 26,
# it found compiled code that does not round as eager ops do, and kept the compiled paths off)
stamp "compiled CPU engine under this torch (GPT-2 2x128, 2 steps, kernels from 256 elements)"
VERITRAIN_COMPILE_MIN_NUMEL=256 timeout 150 "$py" -m veritrain.cli train gpt2-shakespeare --device cpu \
  --set "corpus=$shared/data/shakespeare.txt" --set "tokenizer=$shared/data/gpt2-tokenizer" --set n_layer=2 \
  --set n_embd=128 --set n_head=4 --set max_chars=200000 --steps 2 --checkpoint-every 2 --quiet --json \
  --out "$(mktemp -d)/run" > "$out/compiled-cpu.txt" 2>&1
echo "exit $?; fallback warnings: $(grep -ci 'unavailable\|recompile\|does not round' "$out/compiled-cpu.txt")" | tee -a "$out/compiled-cpu.txt"
stamp done
