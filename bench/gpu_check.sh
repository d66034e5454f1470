#!/usr/bin/env bash
# GPU trainer against CPU auditor, and back: the checks that need a GPU, as one short script.
#
#   bash bench/gpu_check.sh OUT_DIR [SHARED_DIR] [GPU]
#
# SHARED_DIR holds data/shakespeare.txt and data/gpt2-tokenizer (default ../shared). GPU is the device the
# "GPU" side uses (default cuda; cpu runs the whole script here, to try it before a GPU is lent).
#
# With the device tool: copy ../shared/data into the checkout's shared/ (git ignores it, the tool carries
# it), put the zstandard wheel in .whl/ (../.library/device/README.md), and run, carrying .whl:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
#   export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 && timeout 540 bash bench/gpu_check.sh $OUT shared
#   > $OUT/log.txt 2>&1
# Most important first, each part under its own time limit, the summary rewritten after each workload, so a
# run cut short still returns what it measured: the compiled paths op by op on the GPU and on its machine's CPU
# (each with the compiler check); digits-cnn and GPT-2 2 x 128 trained and audited across devices with the
# GPU side's compiled paths forced on; the GPU's step times with them forced on, then with the eager engine;
# the three workloads across devices with the eager engine on both sides; plain float32; the CUDA tests.
# OUT_DIR gets at most 8 files (what the device tool brings back): log.txt is written by the caller; env.txt
# (the compiled paths' tables op by op), summary.md (the cross-device runs' figures, which bench/RESULTS.md
# quotes), audits.tar.gz (every train/audit JSON and error output), runs.tar.gz (the digits-cnn and ResNet runs
# trained on either device, to audit on another machine), bench.md (bench_engine.py's tables on the GPU),
# pytest.txt.
set -u
out=${1:?usage: bash bench/gpu_check.sh OUT_DIR [SHARED_DIR] [GPU]}
shared=${2:-../shared}
gpu=${3:-cuda}
py=${PYTHON:-python3}
work=$(mktemp -d)  # runs and per-command outputs; only packed files go to OUT_DIR
mkdir -p "$out"
# vt LIMIT DEVICE COMMAND ARGS: the CPU side runs the eager engine (VERITRAIN_COMPILE=0: the same bits and log
# as the compiled paths, tests/test_compiled_path.py), since compiling its kernels cold on the GPU machine's
# CPU took most of its minute per audit in session 15; with FORCED=1 the GPU side runs with every compiled path
# forced on (bench/force_compiled.py), which the library keeps to CPUs
vt() {
  local limit=$1 dev=$2 cmd=$3
  if [ "$dev" = cpu ]; then
    VERITRAIN_COMPILE=0 timeout "$limit" "$py" -m veritrain.cli "$cmd" --device cpu "${@:4}"
  elif [ "${FORCED:-0}" = 1 ]; then
    timeout "$limit" "$py" bench/force_compiled.py "$cmd" --device "$dev" "${@:4}"
  else
    timeout "$limit" "$py" -m veritrain.cli "$cmd" --device "$dev" "${@:4}"
  fi
}
t0=$(date +%s)
stamp() { echo "== $(( $(date +%s) - t0 )) s: $*"; }

stamp environment
{ nvidia-smi -L 2>/dev/null; lscpu | grep -m1 'Model name'; nproc
  "$py" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no cuda')"; } 2>&1 | tee "$out/env.txt"

# the compiled paths op by op on the GPU against its eager engine (bench/compiled_conformance.py), into env.txt:
# which kernel left the CPU's bits when runs trained with the compiled paths on CUDA failed their CPU audits
# (session 15), the first thing a compiled GPU path needs; then on that machine's CPU, whose torch (2.11 in
# session 29) failed the compiler check until fused.KEEP_ROUNDINGS, so that its compiled CPU paths were off. Each
# table's header has the compiler check (fused.compiled_code_rounds) on its device, with the values it saw
# differ where it fails.
for dev in "$gpu" cpu; do
  stamp "the compiled paths op by op on $dev"
  timeout 120 "$py" bench/compiled_conformance.py --device "$dev" --no-write 2>&1 \
    | grep '^|\|conform\|^Machine\|check' | tee -a "$out/env.txt"
done

gpt2=(gpt2-shakespeare --set "corpus=$shared/data/shakespeare.txt" --set "tokenizer=$shared/data/gpt2-tokenizer"
      --set n_layer=2 --set n_embd=128 --set n_head=4 --set max_chars=200000 --set lr=1e-3 --set schedule_steps=10)
digits=(digits-cnn)
resnet=(resnet-cifar10 --set data=digits --set arch=resnet18 --set width=8 --set batch_size=16
        --set train_examples=512 --set eval_examples=297)

summarise() {
  "$py" - "$work" "$gpu" > "$out/summary.md" <<'EOF'
import json, os, sys
work, gpu = sys.argv[1], sys.argv[2]
def load(p):
    try:
        return json.load(open(os.path.join(work, p)))
    except (OSError, ValueError):
        return None
print("| workload | trained on | audited on | accepted | steps | corrections forward / backward / optimizer "
      "| per step | suspicious | log entries | final state = other device's trainer | plain float32 final states equal |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for w in ("digits-compiled", "gpt2-compiled", "digits", "gpt2", "resnet"):
    for side, other in (("gpu", "cpu"), ("cpu", "gpu")):
        t, a, t2 = load(f"{w}-{side}-train.json"), load(f"{w}-{side}-audit.json"), load(f"{w}-{other}-train.json")
        f1, f2 = load(f"{w}-{side}-fp32.json"), load(f"{w}-{other}-fp32.json")
        forced = " (compiled paths forced on)" if w.endswith("-compiled") else ""
        d, o = (gpu + forced, "cpu") if side == "gpu" else ("cpu", gpu + forced)
        if not t:
            continue
        if not a:
            print(f"| {w} | {d} | {o} | not finished | {t['steps']} | | | | | | |")
            continue
        c, sus, entries = a["corrections"], a["suspicious"], a["entries"]
        same = "?" if not t2 else t2["final_state_hash"] == t["final_state_hash"]
        fsame = f1["final_state_hash"] == f2["final_state_hash"] if f1 and f2 else "?"
        print(f"| {w} | {d} | {o} | {a['accepted']} | {t['steps']} | {c['forward']} / {c['backward']} / "
              f"{c['optimizer']} | {sum(c.values()) / max(t['steps'], 1):.2f} | {sus} | {entries} | {same} | {fsame} |")
EOF
  (cd "$work" && tar czf "$out/audits.tar.gz" --exclude=runs .)
}

# Each workload: trained verified on the GPU and on the CPU, each audited on the other device. NAME-compiled: the
# same with the GPU side's compiled paths forced on (FORCED=1), so that they train once and audit once, against
# the CPU side's eager engine: end to end, what env.txt's table says op by op.
workload() {
  local name=$1 steps=$2 forced=0
  local w=${name%-compiled}
  [ "$w" != "$name" ] && forced=1
  declare -n args=$w
  for side in gpu cpu; do  # files are named by side, so GPU=cpu (a try-out here) keeps both apart
    other=cpu; dev=$gpu; [ $side = cpu ] && other=gpu dev=cpu
    odev=$gpu; [ $other = cpu ] && odev=cpu
    stamp "$name: trained on $dev, audited on $odev"
    FORCED=$forced vt 150 "$dev" train "${args[@]}" --steps $steps --checkpoint-every 2 --quiet --json \
      --out "$work/runs/$name-$side" > "$work/$name-$side-train.json" 2> "$work/$name-$side-train.err" \
      || tail -3 "$work/$name-$side-train.err"
    FORCED=$forced vt 150 "$odev" audit "$work/runs/$name-$side" --json --quiet --out "$work/runs/$name-$side-audit" \
      > "$work/$name-$side-audit.json" 2> "$work/$name-$side-audit.err" || tail -3 "$work/$name-$side-audit.err"
    summarise
  done
  cat "$out/summary.md"
}

# GPU step times against the same GPU's plain float32 and float64 steps, each run's table into bench.md: with the
# compiled paths forced on (what they would save there), then the eager engine (what a GPU runs now)
bench() {
  local w=$1 label=$2
  shift 2
  stamp "bench/bench_engine.py on $gpu, $label: $w"
  echo "### $w, $label" >> "$out/bench.md"
  timeout 150 "$py" bench/bench_engine.py --device "$gpu" --workloads "$w" --steps 2 --no-write \
    --shared "$shared/data" "$@" 2>&1 | grep '^|\|^Command\|^Machine\|not met\|met:' | tee -a "$out/bench.md"
}

workload digits-compiled 10
workload gpt2-compiled 6
for w in resnet18 gpt2-117m; do bench $w "compiled paths forced on" --force-compiled; done
for w in resnet18 gpt2-117m; do bench $w "the library's rule (the eager engine on a GPU)"; done
workload digits 10
workload gpt2 6
workload resnet 4
# the small runs of both devices (GPT-2's checkpoints hold the 50257-token embedding: too large to bring back)
(cd "$work/runs" && tar czf "$out/runs.tar.gz" digits-gpu digits-cpu digits-compiled-gpu resnet-gpu resnet-cpu \
  2>/dev/null)

for side in gpu cpu; do
  dev=$gpu; [ $side = cpu ] && dev=cpu
  vt 100 "$dev" train digits-cnn --steps 10 --checkpoint-every 10 --quiet --json --mode fp32 \
    --out "$work/runs/digits-$side-fp32" > "$work/digits-$side-fp32.json" 2>/dev/null
done
summarise

# the GPU machine's Python has pytest without pytest-xdist: the repo's addopts (-n 2) would stop it
stamp "the CUDA tests of tests/test_device.py (skipped where no GPU is visible)"
timeout 200 "$py" -m pytest -q -x -p no:cacheprovider -o addopts="" tests/test_device.py -k cuda 2>&1 | tail -25 \
  | tee "$out/pytest.txt"

rm -rf "$work"
stamp done
