#!/usr/bin/env bash
# The Colab-emulation evidence on the GPU machine (one H200, 16 cores): every notebook under
# scripts/colab_emulation.py's limits, run side by side (each kernel in its own cgroup on two cores of its own),
# and the ladder's rungs re-checked, each alone in its own enclosure.
#
#   source .gpu-bundle/setup.sh && bash scripts/gpu_evidence.sh /tmp/evidence      # writes /tmp/evidence/...
#   bash scripts/gpu_evidence.sh --collect /tmp/evidence $OUT                          # tars what is there
#
# DeepSpeed's CUDA/CPU ops are built once first, on all cores, and timed (a notebook that built them itself would
# hold the build lock while the others wait); the notebooks then load them from the cache.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--collect" ]; then
  src=$2; dest=$3
  tar czf "$dest/evidence.tgz" -C "$src" . 2>/dev/null
  exit 0
fi

out=${1:?usage: gpu_evidence.sh OUT_DIR}
mkdir -p "$out/nb" "$out/parts" "$out/logs"
export DS_COURSE_T4_BUDGET=1 PYTHONUNBUFFERED=1
start=$(date +%s)

python3 - >"$out/logs/ops.log" 2>&1 <<'EOF'
import json, time
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder, FusedAdamBuilder
times = {}
for b in (CPUAdamBuilder, AsyncIOBuilder, FusedAdamBuilder):
    t = time.perf_counter()
    b().load()
    times[b.__name__] = round(time.perf_counter() - t, 1)
print(json.dumps(times))
open("build/op_build_seconds.json", "w").write(json.dumps(times))
EOF
cp build/op_build_seconds.json "$out/op_build_seconds.json" 2>/dev/null
echo "ops built after $(( $(date +%s) - start )) s" >>"$out/logs/progress.log"

# notebooks side by side: cores 2k, 2k+1 for notebook k (0-5); the ladder on cores 12-15
pids=()
k=0
for nb in notebooks/0[0-5]_*.ipynb; do
  name=$(basename "$nb" .ipynb)
  python3 scripts/gpu_check.py "$nb" --cpus "$((2 * k)),$((2 * k + 1))" --concurrent 6 \
    --report "$out/parts/$name.json" --out-dir "$out/nb" >"$out/logs/$name.log" 2>&1 &
  pids+=($!)
  k=$((k + 1))
done
taskset -c 12-15 python3 benchmarks/ladder.py --emulate --fresh --out "$out/ladder_colab_emulation.json" \
  --nvme-path /tmp/ladder-nvme --work-dir build/bench-emulated \
  --lanes "0:zero2_offload_cpu,zero3_offload_cpu" "0:zero3_nvme_optimizer_gpu_params,zero3_nvme_optimizer,zero3_nvme_all" \
  >"$out/logs/ladder.log" 2>&1 &
ladder=$!
for p in "${pids[@]}"; do wait "$p"; done
echo "notebooks done after $(( $(date +%s) - start )) s" >>"$out/logs/progress.log"
wait "$ladder"
echo "ladder done after $(( $(date +%s) - start )) s" >>"$out/logs/progress.log"
touch "$out/DONE"
