# Session 20 GPU call (issue 26): the GPU test of checkpoints_on_cpu's buffer release; notebook 06 through gpu_check
# (alone); then benchmarks/long_context.py "+ checkpoints on CPU" at 262,144 tokens in a fresh process.
set -u
source .gpu-bundle/setup.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
mkdir -p /tmp/ev/logs
start=$(date +%s)
log() { echo "$(( $(date +%s) - start )) s: $*" >> /tmp/ev/logs/progress.log; }
save() {
  [ -d /tmp/lc ] && mkdir -p /tmp/ev/lc && cp /tmp/lc/*.jsonl /tmp/lc/run.json /tmp/ev/lc/ 2>/dev/null
  [ -d /tmp/nbev ] && mkdir -p /tmp/ev/nbev && cp -r /tmp/nbev/. /tmp/ev/nbev/ 2>/dev/null
  tar czf "$OUT/ev.tgz.tmp" -C /tmp/ev . && mv "$OUT/ev.tgz.tmp" "$OUT/ev.tgz"
}
( while sleep 30; do save; done ) &
saver=$!
python3 -c "import torch; print(torch.__version__, sorted(torch.cuda.host_memory_stats())[:40])" > /tmp/ev/logs/host_stats_keys.txt 2>&1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_long_context.py -k "checkpoints_on_cpu or train_at_length" \
  > /tmp/ev/logs/pytest_gpu.log 2>&1
log "pytest rc=$?"
BUILD_OPS="" LOCAL_HUB=0 LADDER_ARGS=none timeout 300 bash scripts/gpu_evidence.sh /tmp/nbev notebooks/06_long_context.ipynb
log "notebook 06 gpu_evidence rc=$?"
save
left=$(( 585 - ($(date +%s) - start) ))
log "benchmark gets ${left} s"
timeout $left python3 benchmarks/long_context.py --emulate --rungs "+ checkpoints on CPU" --lengths 262144 \
  --rung-timeout-s $(( left - 25 )) --out /tmp/ev/lc.json --work-dir /tmp/lc > /tmp/ev/logs/lc.log 2>&1
log "benchmark rc=$?"
kill $saver 2>/dev/null
nvidia-smi > /tmp/ev/logs/nvidia-smi.txt 2>&1
save
ls -la "$OUT"; cat /tmp/ev/logs/progress.log; tail -5 /tmp/ev/logs/pytest_gpu.log; tail -20 /tmp/ev/logs/lc.log
