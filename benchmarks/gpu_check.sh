#!/usr/bin/env bash
# GPU throughput check (never part of the tests): ResNet-50 on synthetic 224 px data through
# the real `python train.py`, bf16 and fp16, channels_last, with and without torch.compile.
# One line of images/s each; about 5 minutes on one GPU.
#
#   bash benchmarks/gpu_check.sh            # after `make train` (or scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || bash scripts/setup.sh >/dev/null
"$PY" - <<'PY'
import torch, sys
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA GPU visible")
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for precision in bf16 fp16; do
    for compile in false true; do
        dir="$out/$precision-$compile"
        "$PY" train.py model=resnet50 dataset=synthetic dataset.image_size=224 \
            dataset.num_train=12800 dataset.num_val=256 dataset.num_workers=8 \
            trainer.batch_size=256 trainer.max_epochs=1 trainer.limit_train_batches=60 \
            trainer.log_every_n_steps=20 trainer.channels_last=true trainer.compile=$compile \
            precision=$precision logger=csv trainer.progress=none optimizer=sgd \
            "hydra.run.dir=$dir" > "$dir.log" 2>&1 || { echo "$precision compile=$compile: FAILED ($dir.log)"; tail -5 "$dir.log"; continue; }
        # The last logged window (steps 41-60) is past warm-up and compilation.
        "$PY" -c "
import json, sys
rows = [json.loads(l) for l in open('$dir/metrics.jsonl') if 'perf/images_per_s' in l]
print(f'resnet50 224px {\"$precision\"} channels_last compile=$compile: '
      f'{rows[-1][\"perf/images_per_s\"]:.0f} images/s (data wait {rows[-1][\"perf/data_wait_frac\"]:.0%})')"
    done
done
