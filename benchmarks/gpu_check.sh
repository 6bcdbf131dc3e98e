#!/usr/bin/env bash
# GPU checks (never part of the tests), one figure per line. Parts 1, 2 and 6 took about 6
# minutes on one H200; 3-5 are new and have not run on a GPU yet (none lent since):
#   1. `labrun bench data` with the batches normalised on the GPU, as the trainer does, then
#      on the CPU, on this machine's cores;
#   2. ResNet-50 training through the real `python train.py` on synthetic 224 px data:
#      bf16 and fp16 with channels_last, and bf16 with torch.compile;
#   3. batched decoding on the GPU (dataset.decode=cuda, nvJPEG) against ResNet-50's pace;
#   4. `labrun bench serve` on CUDA: dynamic batching against the same server at --max-batch 1;
#   5. a run's Prometheus endpoint scraped mid-run: the GPU utilisation it reports;
#   6. `labrun doctor` (GPU, CUDA, NCCL).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]     # after `make train`; PY=python3 for another env
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || command -v "$PY" >/dev/null || bash scripts/setup.sh >/dev/null
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
labrun() { "$PY" -c 'import sys; from labrun.cli import main; sys.exit(main())' "$@"; }

"$PY" - <<'PY' || exit 1
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA GPU visible")
from labrun.data.image import decode
region = "compiled" if decode._decode_region else "NOT compiled (whole-image fallback)"
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
      f"CUDA {torch.version.cuda}; JPEG region decoding {region}")
PY

echo "== labrun bench data (2 workers), normalised on the GPU, then on the CPU"
# The table and the verdicts (one line per target), without the per-round lines.
labrun bench data --device cuda --json "$OUT/bench_data_cuda.json" 2>&1 | grep -vE "^ +round "
labrun bench data --device cpu --json "$OUT/bench_data_cpu.json" 2>&1 | grep -E "speedup|ceiling|target"

echo "== ResNet-50 training, synthetic 224 px, batch 256, channels_last"
for run in bf16:false fp16:false bf16:true; do
    precision=${run%:*} compile=${run#*:}
    dir="$OUT/train-$precision-compile-$compile"
    "$PY" train.py model=resnet50 dataset=synthetic dataset.image_size=224 \
        dataset.num_train=10240 dataset.num_val=512 dataset.num_workers=12 \
        trainer.batch_size=256 trainer.max_epochs=1 trainer.limit_train_batches=40 \
        trainer.log_every_n_steps=20 trainer.channels_last=true trainer.compile="$compile" \
        precision="$precision" logger=csv trainer.progress=none optimizer=sgd \
        "hydra.run.dir=$dir" > "$dir.log" 2>&1 \
        || { echo "$precision compile=$compile: FAILED"; tail -5 "$dir.log"; continue; }
    # The last logged window (steps 21-40) is past warm-up and compilation.
    "$PY" - "$dir" "$precision" "$compile" <<'PY'
import json, sys
run_dir, precision, compile = sys.argv[1:]
rows = [json.loads(l) for l in open(f"{run_dir}/metrics.jsonl")]
perf = [r for r in rows if "perf/images_per_s" in r][-1]
val = [r for r in rows if "val/acc" in r][-1]
print(f"resnet50 224px {precision} channels_last compile={compile}: "
      f"{perf['perf/images_per_s']:.0f} images/s, data wait {perf['perf/data_wait_frac']:.0%}, "
      f"loss {perf['train/loss']:.3f}, val/acc {val['val/acc']:.3f}")
PY
done

echo "== batched decoding on the GPU (decode=cuda, 4 workers) against ResNet-50 bf16 training"
labrun bench data --device cuda --decode-device cuda --workers 4 --batch-size 256 \
    --json "$OUT/bench_data_decode_cuda.json" 2>&1 | grep -E "hdf5|resnet50|feeds|target"

echo "== labrun bench serve --clients 16 on CUDA: batched vs --max-batch 1"
labrun bench serve --clients 16 --json "$OUT/bench_serve.json" 2>&1 | grep -vE "^ +round "

echo "== a training run's metrics endpoint, scraped mid-run: GPU utilisation"
dir="$OUT/train-monitored"
"$PY" train.py model=resnet18 dataset=synthetic dataset.image_size=224 dataset.num_train=20480 \
    dataset.num_workers=8 trainer.batch_size=256 trainer.max_epochs=1 \
    trainer.limit_train_batches=80 precision=bf16 logger=csv trainer.progress=none \
    "hydra.run.dir=$dir" > "$dir.log" 2>&1 &
train_pid=$!
"$PY" - "$dir" "$train_pid" <<'PY'
import json, os, pathlib, sys, time, urllib.request
run_dir, pid = pathlib.Path(sys.argv[1]), int(sys.argv[2])
node = run_dir / "monitor" / "node-0.json"
deadline = time.time() + 180
while not node.exists() and time.time() < deadline and os.path.exists(f"/proc/{pid}"):
    time.sleep(1)
if not node.exists():
    sys.exit("monitor: the run wrote no monitor/node-0.json")
time.sleep(20)  # past start-up, inside the training steps
url = json.loads(node.read_text())["url"]
text = urllib.request.urlopen(url, timeout=10).read().decode()
seen = [line for line in text.splitlines() if line.startswith("labrun_gpu_")]
print("monitor: " + ("; ".join(seen) if seen else "NO labrun_gpu_* series on a GPU run"))
PY
wait "$train_pid" && grep -h '"perf/gpu_util"' "$dir/metrics.jsonl" | tail -1

echo "== labrun doctor"
labrun doctor 2>&1 | tail -25
