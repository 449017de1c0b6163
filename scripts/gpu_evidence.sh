#!/usr/bin/env bash
# The Colab-emulation evidence on the GPU machine (one H200, 16 cores): notebooks under scripts/colab_emulation.py's
# limits, run side by side (each kernel in its own cgroup on two cores of its own), and the ladder's rungs re-checked,
# each alone in its own enclosure, on the cores left.
#
#   source .gpu-bundle/setup.sh && bash scripts/gpu_evidence.sh /tmp/evidence [NOTEBOOK ...]   # default: every notebook
#   LADDER_ARGS="--sizes gpt2-large gpt2-xl ..." bash scripts/gpu_evidence.sh ...   # ladder options; LADDER_ARGS=none: no ladder
#   bash scripts/gpu_evidence.sh --collect /tmp/evidence $OUT                        # tars what is there
#   LOCAL_HUB=0 bash scripts/gpu_evidence.sh ...   # no Hub cache built here (01/04 take their offline branch unless
#       HF_HOME and HF_HUB_OFFLINE=1 already point at one: a second run beside the first reads the first one's)
#   TWICE=1 LADDER_ARGS=none bash scripts/gpu_evidence.sh /tmp/ev NOTEBOOK ...   # each notebook twice, side by side
#       (the second run from a copy of the checkout, on the next cores, into /tmp/ev/run_b), then scripts/verdicts.py
#       compares the two runs' verdict lines into /tmp/ev/verdicts.md (issue 40). At most 4 notebooks (2 x 2 x 4 cores)
#   FIRST_CPU, CONCURRENT: the first core of this run's enclosures and how many notebooks share the GPU (TWICE sets them)
#   HOST_MEMORY_ARGS="--sizes gpt2-xl gpt2-2.7b --seq-len 512" bash scripts/gpu_evidence.sh ...  # also the host byte
#       account (benchmarks/host_memory.py, issue 25) on the cores left, not enclosed: it measures the need. Mind the
#       64 GB disk: a 2.7B NVMe optimizer writes ~42 GB beside notebook 02's NVMe folder
#   LONG_CONTEXT_ARGS="--parallel 5 --deadline-s 300" bash scripts/gpu_evidence.sh /tmp/ev notebooks/06_*.ipynb
#       also benchmarks/long_context.py --emulate (issue 26) on the cores left: each rung in its own Colab enclosure
#       (BUILD_OPS=CPUAdamBuilder LOCAL_HUB=0 LADDER_ARGS=none: only --optimizer-offload loads an op; no Hub, no ladder)
#
# The notebooks take Colab's branches, the Hub ones included: scripts/local_hub.py first builds a Hugging Face cache
# with GPT-2 (124M, course-initialised) and the WikiText stand-in, and the runs read it with HF_HUB_OFFLINE=1 (nothing is
# downloaded), so `from_pretrained("gpt2")`'s RAM is in the measurement as on Colab.
# DeepSpeed's ops are built first, on all cores, one process per op, and timed (a notebook that built them itself
# would hold the build lock while the others wait); the notebooks then load them from the cache.
set -uo pipefail
cd "$(dirname "$0")/.."
# The GPU machine has no editable install of helpers (the bundle holds only third-party wheels): this checkout's
# helpers go first on the path of every script, kernel and launched program (run B's copy puts its own first)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

if [ "${1:-}" = "--collect" ]; then
  tar czf "$3/evidence.tgz" -C "$2" . 2>/dev/null
  exit 0
fi

out=${1:?usage: gpu_evidence.sh OUT_DIR [NOTEBOOK ...]}
shift
notebooks=("$@")
[ ${#notebooks[@]} -gt 0 ] || notebooks=(notebooks/[0-9][0-9]_*.ipynb)
mkdir -p "$out/nb" "$out/parts" "$out/logs"
out=$(cd "$out" && pwd)  # absolute: TWICE's second run starts from another folder
export DS_COURSE_T4_BUDGET=1 PYTHONUNBUFFERED=1
start=$(date +%s)

ops=${BUILD_OPS-CPUAdamBuilder AsyncIOBuilder FusedAdamBuilder}  # BUILD_OPS="": none (notebook 06 loads no op)
for op in $ops; do
  python3 -c "import json, time; from deepspeed.ops.op_builder import $op as B; t = time.perf_counter(); B().load(); \
print(json.dumps({'$op': round(time.perf_counter() - t, 1)}))" >"$out/logs/op-$op.log" 2>&1 &
done
wait
[ -z "$ops" ] || echo "ops built after $(( $(date +%s) - start )) s" >>"$out/logs/progress.log"
if [ "${LOCAL_HUB:-1}" = 1 ]; then
  python3 scripts/local_hub.py /tmp/ds-course-hf-home --model-size gpt2 --env-file "$out/logs/hub.env" \
    >"$out/logs/local_hub.log" 2>&1 && source "$out/logs/hub.env"
  echo "local Hub cache built after $(( $(date +%s) - start )) s (HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-unset})" >>"$out/logs/progress.log"
fi

asked() { [ -n "${!1:-}" ] && [ "${!1}" != "none" ]; }  # HOST_MEMORY_ARGS, LONG_CONTEXT_ARGS: set and not "none"
if [ "${TWICE:-0}" = 1 ]; then
  # issue 40's two-run check: the same notebooks again, side by side with this run, from a copy of the checkout (each
  # notebook's build/ folder is its own), on the cores after this run's; scripts/verdicts.py compares the two
  copy=/tmp/ds-course-run-b
  rm -rf "$copy" && mkdir -p "$copy" && tar --exclude=./build --exclude=./.gpu-bundle -cf - . | tar -xf - -C "$copy"
  export CONCURRENT=$((2 * ${#notebooks[@]}))
  (cd "$copy" && TWICE=0 BUILD_OPS="" LOCAL_HUB=0 LADDER_ARGS=none FIRST_CPU=$((2 * ${#notebooks[@]})) \
    bash scripts/gpu_evidence.sh "$out/run_b" "${notebooks[@]}") &
  run_b=$!
fi
beside=""  # the benchmarks started below, named in each notebook's entry (they share the GPU)
[ "${LADDER_ARGS:-}" = "none" ] || beside="benchmarks/ladder.py"
if asked HOST_MEMORY_ARGS; then beside="${beside:+$beside, }benchmarks/host_memory.py"; fi
if asked LONG_CONTEXT_ARGS; then beside="${beside:+$beside, }benchmarks/long_context.py"; fi
pids=()
k=0
first_cpu=${FIRST_CPU:-0}                        # FIRST_CPU=6: this run's enclosures from core 6 on (another run beside)
concurrent=${CONCURRENT:-${#notebooks[@]}}        # CONCURRENT=6: notebooks on the GPU at once, this run's and others'
for nb in "${notebooks[@]}"; do
  name=$(basename "$nb" .ipynb)
  python3 scripts/gpu_check.py "$nb" --cpus "$((first_cpu + 2 * k)),$((first_cpu + 2 * k + 1))" --concurrent "$concurrent" \
    --beside "$beside" --report "$out/parts/$name.json" --out-dir "$out/nb" >"$out/logs/$name.log" 2>&1 &
  pids+=($!)
  k=$((k + 1))
done
if [ "${LADDER_ARGS:-}" != "none" ]; then
  first=$((2 * k))
  # shellcheck disable=SC2086
  taskset -c "$first-15" python3 benchmarks/ladder.py --emulate --fresh --out "$out/ladder_colab_emulation.json" \
    --nvme-path /tmp/ladder-nvme --work-dir build/bench-emulated ${LADDER_ARGS:-} >"$out/logs/ladder.log" 2>&1 &
  pids+=($!)
fi
if asked HOST_MEMORY_ARGS; then
  # shellcheck disable=SC2086
  taskset -c "$((2 * k))-15" python3 benchmarks/host_memory.py --quiet --out "$out/host_memory.json" \
    --nvme-path /tmp/host-memory-nvme ${HOST_MEMORY_ARGS} >"$out/logs/host_memory.log" 2>&1 &
  pids+=($!)
fi
if asked LONG_CONTEXT_ARGS; then
  # shellcheck disable=SC2086
  taskset -c "$((2 * k))-15" python3 benchmarks/long_context.py --emulate --out "$out/long_context.json" \
    --work-dir /tmp/long-context ${LONG_CONTEXT_ARGS} >"$out/logs/long_context.log" 2>&1 &
  pids+=($!)
fi
for p in "${pids[@]}"; do wait "$p"; done
if [ -n "${run_b:-}" ]; then
  wait "$run_b"
  python3 scripts/verdicts.py "$out/nb" "$out/run_b/nb" --out "$out/verdicts.md" >"$out/logs/verdicts.log" 2>&1
  echo "verdicts compared (exit $?: 0 = no flip, 1 = flips, 2 = nothing to compare)" >>"$out/logs/progress.log"
fi
echo "all done after $(( $(date +%s) - start )) s" >>"$out/logs/progress.log"
touch "$out/DONE"
