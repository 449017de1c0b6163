#!/usr/bin/env bash
# Every GPU step the course is waiting for, in one script (docs/decisions.md names it). On the device machine:
#   source .gpu-bundle/setup.sh && bash scripts/gpu_pending.sh STEP [STEP ...]      (writes under $OUT)
# Steps, each sized for one 600 s call (in this order; a step needs nothing from an earlier one):
#   notebooks     the drafts promoted in this copy of the checkout (scripts/promote_drafts.py), then all eight
#                 notebooks side by side under the Colab T4 emulation (scripts/gpu_evidence.sh: each kernel in its own
#                 cgroup on 2 cores, the T4 budget cap; ~540 s with 02 the longest). Brings back evidence.tgz
#                 (parts/*.json, nb/*.ipynb, logs/)
#   context_long  benchmarks/cuda_context.py --nccl-variants first (the GPU must be idle: what a course process holds
#                 outside PyTorch's allocator, part by part, and under NCCL's settings), then the long-context search again for the rungs whose
#                 committed longest length ran within 1 GiB of the old 15 GiB cap (issue 51), 5 rungs side by side, each
#                 in its own enclosure; the optimizer-on-CPU rung's row is kept (its GPU peak, 6.6 GiB, is far from any
#                 cap: RAM ends it). Brings back cuda_context.*, long_context.json/.md/.log, long_context_logs.tgz
#   speed_twice   the two-run check of issue 52: notebooks 01 and 04 (SPEED_NBS="03 06": those) each ALONE on
#                 the GPU, twice, under the emulation, then scripts/verdicts.py on the two runs (verdicts.md); 03
#                 alone takes ~265 s a run: SPEED_NBS="03" needs ~500 s
#   drafts_alone  (a short call, when too little device time is left for `notebooks`) benchmarks/cuda_context.py,
#                 then the drafts 00, 01, 04 promoted and run each ALONE under the emulation, 01 and 04 twice, then
#                 verdicts.py (verdicts.md): run a's executed copies and parts come back as evidence.tgz (~400 s)
#   zero0         benchmarks/zero0_fp16_step.py --profile: one fp16 step of GPT-2 small as plain AMP, ZeRO-0 with
#                 torch_adam true and false (FusedAdam: its fused_adam op is JIT-built first) and ZeRO-2, with
#                 torch.profiler's host-device syncs per step (docs/decisions.md: ZeRO-0 in fp16 is slow; ~70 s), on 2
#                 cores. Brings back zero0_fp16_step_2cpus.json/.md and zero0.log (commit as reports/zero0_fp16_step_2cpus.*)
#   bf16_ram      benchmarks/ladder.py in bf16 on the whole GPU (no emulation), ZeRO-3 offload rungs of GPT-2 large
#                 and XL (issue 41 item 6: the RAM estimate for bf16 on a GPU). Brings back ladder_bf16.json/.md/.log
#                 (commit as reports/ladder_bf16.*; tests/test_ladder checks pre-flight against it). ~300 s
#   big_speed     issue 42 item 2: GPT-2 2.7B with the NVMe optimizer at XL's best unpinned lever (micro-batch 16 x 8,
#                 the course's overflow check; pre-flight's RAM for it: 10.67 GB, the 2.7B ladder rung peaked at 10.95)
#                 in the emulation, 2 optimizer steps (1 untimed) of 65,536 tokens, beside the step-time model's
#                 prediction (~400 s). Brings back offload_speed_2p7b.json/.md/.log (commit as reports/offload_speed_2p7b.*)
#   capstone_xl   notebook 07's section-6 plan (GPT-2 XL, fresh runtime) run for real in the emulation by
#                 benchmarks/capstone.py: 4 steps, RAM peak by phase beside the plan (~400 s; reports/capstone_xl.*)
#   big_curve     issue 42 item 3: GPT-2 2.7B learning over 13 optimizer steps of 32,768 tokens (lr 1e-4, warm-up 6,
#                 the course's overflow check) in the emulation, ~12 min: started in its own session, polled 540 s;
#   big_curve_collect  the next call, AT ONCE (the machine goes back after 30 s idle): polls 540 s more and brings
#                 back ladder_2p7b_curve.json/.md and curve.log (commit as reports/ladder_2p7b_curve.*)
# CURVE_POLL=SECONDS: how long big_curve / big_curve_collect wait for the curve (default 540; after `notebooks` in the
#   same call: CURVE_POLL=$(( 585 - SECONDS )) bash scripts/gpu_pending.sh big_curve).
# DRAFTS="01": drafts_alone promotes and runs that draft only (with RUNS=a and the context: ~220 s).
# RUNS=a: drafts_alone and speed_twice run each notebook once (no verdicts.md; ~300 s for drafts_alone).
# PROMOTE="00 01 04": the notebooks step promotes these drafts only (default: every draft in the checkout).
# EVIDENCE_TIMEOUT (default 520 s) stops the notebooks step's runs in time for what finished to come back.
# Afterwards, here: docs/decisions.md "How to land a GPU run" says what goes where.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT (the device machine sets it)}
start=$(date +%s)
say() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/progress.log"; }

step_notebooks() {
  python3 scripts/promote_drafts.py ${PROMOTE:-} | tee -a "$OUT/progress.log"  # PROMOTE="00 01": these drafts only
  LADDER_ARGS=none timeout "${EVIDENCE_TIMEOUT:-520}" bash scripts/gpu_evidence.sh /tmp/ev
  say "notebooks: exit $?, $(ls /tmp/ev/parts | wc -l) parts"
  bash scripts/gpu_evidence.sh --collect /tmp/ev "$OUT"
}

step_context_long() {
  # with --nccl-variants: DeepSpeed's step again under NCCL's channel/buffer settings, to place issue 51's allowance
  timeout 170 python3 benchmarks/cuda_context.py --nccl-variants --out "$OUT/cuda_context.json" \
    >"$OUT/cuda_context.log" 2>&1
  say "cuda_context: exit $?"
  # a rung stops at 320 s (its unfinished length counts as such) so that the report and the lines come back
  timeout 385 python3 benchmarks/long_context.py --emulate --optimizer-offload --parallel 5 --rung-timeout-s 320 \
    --rungs "plain" "checkpointing" "+ tiled logits" "+ tiled MLP" "+ checkpoints on CPU" \
    --keep-rows-from reports/long_context.json --out "$OUT/long_context.json" --work-dir /tmp/long-context \
    >"$OUT/long_context.log" 2>&1
  say "long_context: exit $?"
  tar czf "$OUT/long_context_logs.tgz" -C /tmp long-context 2>/dev/null
}

alone_twice() {  # alone_twice NOTEBOOK...: each notebook alone on the GPU, run a then run b; verdicts.py on the two
  local hub=1  # the local Hub cache is built once (the first run); later runs read it (hub.env)
  for run in ${RUNS:-a b}; do  # RUNS=a: once (a call too short for two)
    for nb in "$@"; do
      [ "$run" = b ] && [ "$(basename "$nb" | cut -c1-2)" = 00 ] && continue  # 00 compares no speed: once
      BUILD_OPS="" LADDER_ARGS=none LOCAL_HUB=$hub FIRST_CPU=0 CONCURRENT=1 bash scripts/gpu_evidence.sh "/tmp/speed/$run" "$nb"
      say "alone, run $run: $(basename "$nb") $(grep -ho '"passed": [a-z]*' "/tmp/speed/$run/parts/$(basename "$nb" .ipynb).json" | head -1)"
      [ "$hub" = 0 ] || { source /tmp/speed/a/logs/hub.env; hub=0; }
    done
    # run a's executed copies and parts (the ones to commit) come back even if the call ends during run b
    [ "$run" != a ] || bash scripts/gpu_evidence.sh --collect /tmp/speed/a "$OUT"
  done
  python3 scripts/verdicts.py /tmp/speed/a/nb /tmp/speed/b/nb --out "$OUT/verdicts.md" >"$OUT/verdicts.log" 2>&1
  say "verdicts: exit $? (0 = no flip, 1 = flips, 2 = nothing compared)"   # run a: the executed copies and parts to commit
  tar czf "$OUT/run_b.tgz" -C /tmp/speed b 2>/dev/null
}

step_speed_twice() {  # SPEED_NBS="03 06": other notebooks (default 01 04), each promoted first if it is a draft
  local n nbs=()
  ls notebooks/drafts/*.ipynb >/dev/null 2>&1 && python3 scripts/promote_drafts.py ${SPEED_NBS:-01 04} | tee -a "$OUT/progress.log"
  for n in ${SPEED_NBS:-01 04}; do nbs+=(notebooks/${n}_*.ipynb); done  # after the promotion: a draft is here now
  alone_twice "${nbs[@]}"
}

step_drafts_alone() {
  timeout 150 python3 benchmarks/cuda_context.py --out "$OUT/cuda_context.json" >"$OUT/cuda_context.log" 2>&1
  say "cuda_context: exit $?"
  local n nbs=()
  for n in ${DRAFTS:-00 01 04}; do nbs+=(notebooks/${n}_*.ipynb); done  # DRAFTS="01": that draft only
  python3 scripts/promote_drafts.py ${DRAFTS:-} | tee -a "$OUT/progress.log"
  alone_twice "${nbs[@]}"
}

step_zero0() {
  # on 2 cores (the emulation's share; reports/zero0_fp16_step.md is the whole machine's 16, 2026-12-07): does the
  # host's share make ZeRO-0 fp16 x0.17 of plain AMP in notebook 01, where 16 cores gave x0.62?
  timeout 200 python3 benchmarks/zero0_fp16_step.py --profile --cpus 2 --out "$OUT/zero0_fp16_step_2cpus.json" \
    > "$OUT/zero0.log" 2>&1
  say "zero0_fp16_step --cpus 2: exit $?"
}

step_big_speed() {
  # the pinned lever is left out: pre-flight does not count pinning's extra RAM yet (XL measured +2.75 GB with it)
  timeout 540 python3 benchmarks/offload_speed.py --emulate --model gpt2-2.7b --levers mb16_g8_chunked --steps 2 \
    --untimed-steps 1 --hard-stop-s 520 --nvme-path /tmp/nvme-2p7b --work-dir /tmp/os-2p7b \
    --out "$OUT/offload_speed_2p7b.json" >"$OUT/offload_speed_2p7b.log" 2>&1
  say "offload_speed 2.7B: exit $?"
}

step_capstone_xl() {
  # notebook 07's section 6 plans GPT-2 XL for a fresh runtime (zero3_nvme_optimizer_gpu_params, RAM 10.34 GB
  # predicted) and never runs it; the plan leaves out the script's own Python/torch/CUDA (decisions.md). Run it: the
  # stand-in built apart, then train.py from a lean driver inside the emulation, 4 steps, the RAM peak by phase beside
  # the plan. Without --consolidate: with it the disk needs ~59 GB (benchmarks/capstone.py), this machine has 64.
  # Alone, after the 2.7B runs' folders are gone (~45 GB of disk). ~400 s. Commit as reports/capstone_xl.*
  rm -rf /tmp/capstone /tmp/cap-nvme /tmp/curve-nvme /tmp/nvme-2p7b /tmp/bf16-nvme
  local free; free=$(df -Pk /tmp | awk 'NR==2 {print int($4 / 1e6)}')
  [ "$free" -ge 52 ] || { say "capstone_xl: ${free} GB free under /tmp, it needs ~52: not run"; return 1; }
  timeout 240 python3 benchmarks/capstone.py --prepare --emulate --model gpt2-xl \
    --nvme-path /tmp/cap-nvme --work-dir /tmp/capstone >"$OUT/capstone_xl.log" 2>&1
  say "capstone_xl prepare: exit $?"
  timeout 330 python3 scripts/colab_emulation.py --exec -- python3 benchmarks/capstone.py --emulate \
    --model gpt2-xl --steps 4 --no-consolidate --nvme-path /tmp/cap-nvme --work-dir /tmp/capstone \
    --out "$OUT/capstone_xl.json" >>"$OUT/capstone_xl.log" 2>&1
  say "capstone_xl: exit $? (the enclosure's peaks: the last line of capstone_xl.log)"
  rm -rf /tmp/capstone /tmp/cap-nvme
}

step_bf16_ram() {
  # issue 41 item 6: pre-flight's RAM for bf16 on a GPU (no fp16 overflow check, no CPU 'staging'), on the whole GPU
  # (no emulation: bf16 is what a bigger GPU runs); every rung runs, the ones pre-flight would refuse included
  DS_COURSE_T4_BUDGET= timeout 400 python3 benchmarks/ladder.py --sizes gpt2-large gpt2-xl \
    --configs zero3_offload_cpu zero3_nvme_optimizer_gpu_params zero3_nvme_optimizer \
    --verify-refusals zero3_offload_cpu zero3_nvme_optimizer_gpu_params zero3_nvme_optimizer \
    --fresh --deadline-s 300 --nvme-path /tmp/bf16-nvme --work-dir /tmp/bf16-bench \
    --out "$OUT/ladder_bf16.json" >"$OUT/ladder_bf16.log" 2>&1
  say "ladder bf16: exit $?"
}

curve_poll() {  # curve_poll SECONDS: wait that long at most for the background 2.7B curve, then bring back its files
  local until=$(( $(date +%s) + $1 ))
  while [ ! -e /tmp/curve/DONE ] && [ "$(date +%s)" -lt "$until" ]; do sleep 10; done
  cp /tmp/curve/ladder_2p7b_curve.json /tmp/curve/ladder_2p7b_curve.md /tmp/curve/curve.log "$OUT/" 2>/dev/null
  if [ -e /tmp/curve/DONE ]; then say "2.7B curve: finished, exit $(cat /tmp/curve/DONE)"
  else say "2.7B curve: still running: call big_curve_collect now (the machine goes back after 30 s idle)"; fi
}

step_big_curve() {
  # issue 42 item 3: GPT-2 2.7B, the NVMe optimizer, 13 optimizer steps (1 untimed) of 16 x 4 x 512 = 32,768 tokens,
  # lr 1e-4 warmed up over 6 (reports/lr_warmup_cpu.md), the course's overflow check, in the emulation: ~49 s a step
  # (reports/offload_speed_2p7b.md: the disk ~40 s of it) + ~100 s setup, ~12 min: more than one call. It runs in a
  # session of its own (setsid), which lives on between calls while the machine is held; this call polls 540 s and
  # the next, `big_curve_collect` (at once: the machine goes back after 30 s idle), polls again and brings it back.
  # Alone: never beside notebook 02 (the disk, decisions.md). Commit as reports/ladder_2p7b_curve.*
  rm -rf /tmp/curve /tmp/curve-nvme; mkdir -p /tmp/curve
  setsid bash -c 'python3 benchmarks/ladder.py --emulate --fresh --sizes gpt2-2.7b \
    --configs zero3_nvme_optimizer_gpu_params --verify-refusals --micro-batch 16 --grad-accum 4 --steps 13 \
    --untimed-steps 1 --lr 1e-4 --warmup-steps 6 --chunked-overflow-check --nvme-path /tmp/curve-nvme \
    --work-dir /tmp/curve/work --out /tmp/curve/ladder_2p7b_curve.json >/tmp/curve/curve.log 2>&1
    echo $? >/tmp/curve/DONE' </dev/null >/dev/null 2>&1 &
  curve_poll "${CURVE_POLL:-540}"  # CURVE_POLL=180: after another step in the same call
}

step_big_curve_collect() {
  [ -d /tmp/curve ] || { say "no /tmp/curve here: a fresh machine (the last one went back); run big_curve again"; return 1; }
  curve_poll "${CURVE_POLL:-540}"
}

[ $# -gt 0 ] || { echo "usage: gpu_pending.sh notebooks|context_long|speed_twice|drafts_alone|zero0|big_speed|big_curve|big_curve_collect|bf16_ram|capstone_xl ..." >&2; exit 2; }
for s in "$@"; do
  say "step $s"
  "step_$s"
done
say "done"
