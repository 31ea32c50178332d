#!/usr/bin/env bash
# The H200 runs behind bench/results/*_h200.json, from the repository root on a CUDA machine:
#   bench/h200_session.sh benches MUSUBI_FILE   # side by side with musubi, Qwen-Image 20B, optimizer, fp8, determinism
#   bench/h200_session.sh optim                 # the optimizer-offload toy and its GPU tests
#   bench/h200_session.sh e2e                   # splitflow run, full-depth Qwen-Image folder
#   bench/h200_session.sh bound                 # Qwen-Image 24 GB rows with their floor under any schedule
#   bench/h200_session.sh compiled              # compiled blocks with and without the block inputs offloaded
#   bench/h200_session.sh narrow MUSUBI_FILE    # adapters saving their bf16 input: GPU tests, stack peaks
#                                               # (and the fp32-copy stack beside them), Qwen-Image 24 GB rows
#   bench/h200_session.sh peak MUSUBI_FILE       # issue-12 peaks: GPU tests, stack rows (+ offloaded
#                                                # block inputs), Qwen-Image 20B fp8 under 16 GB
#                                                # (PROFILE_STEP=6: where each row's step 7 waits;
#                                                #  ROWS=none skips the stack rows)
#   bench/h200_session.sh hoststate MUSUBI_FILE  # AdamW's moments in host memory: GPU tests, stack rows
#                                                # (QWEN_ROWS=...: Qwen-Image rows after them)
#   bench/h200_session.sh bwdstep MUSUBI_FILE    # steps during backward (StepInBackward): GPU tests, stack rows
#                                                # (SKIP_NONFINITE=1: as the Trainer runs it)
#   bench/h200_session.sh interleave MUSUBI_FILE # the 12-of-24 row and resident alternately in one process
#                                                # (PAIRS=6; INTERLEAVE=rows; COPIES=1: the copies alone),
#                                                # the optimizer toy with its GPU-step row (OPTIM=0: not),
#                                                # and the optimizer-state GPU tests
#   bench/h200_session.sh packed                 # packed bf16 / fp8 kernels: their GPU tests, the widening
#                                                # kernels alone (bench.offload --cases widen), the optimizer toy
#   bench/h200_session.sh packed20b              # packed GPU tests, the widening kernels, then Qwen-Image 20B:
#                                                # resident, packed within 24 GB (eager and compiled), fp8
#                                                # within 16 GB compiled (QWEN_ROWS=...: others)
#   bench/h200_session.sh diagnose               # the 12-of-24 row taken apart (MODES=...: bench/interleaved.py's
#                                                # diagnoses, 8 pairs each; BUDGET_GIB for the engine rows)
#   bench/h200_session.sh pair MUSUBI_FILE       # musubi's 12-swapped stack (SWAP=13: 13 swapped), then our 12-of-24
#                                                # row, each alternated with resident in its own process (PAIRS=6)
#                                                # (CLOCKS=1: our row's SM clock and power, NVML)
#   bench/h200_session.sh three MUSUBI_FILE      # resident, musubi's 12-swapped offloader and our 12-of-24 row
#                                                # rotated in one process (ROUNDS=12 rounds, every order of the
#                                                # three in turn), PROCS=3 processes (bench/musubi_harness.py --ours);
#                                                # SWAP=13: musubi swapping 13 blocks, so that its memory is
#                                                # the row's (files three_way_swap13_r*); BUDGET_GIB: our row's
#   bench/h200_session.sh floor                  # resident, the 12-of-24 row's bytes beside resident compute
#                                                # ("floor": no engine) and the row, rotated in one process
#                                                # (bench/interleaved.py --floor; ROUNDS=12, PROCS=3, CLOCKS=1:
#                                                # NVML; COPY_GIB: the row's weight bytes a step / 24)
#                                                # TAG=b: files floor_MODE_b_r*; FLOOR=gated: the
#                                                # floor's copies wait for compute, as a ring's do
#   bench/h200_session.sh rows                   # RUNS="MODE@BUDGET_GIB ...": bench/interleaved.py rows, one
#                                                # process each (PAIRS=6), e.g. the 12-of-24 row with its
#                                                # blocks split into their Linears (budget_12_of_24_act_leaves);
#                                                # CLOCKS=1: each side's SM clock and power (NVML)
#   bench/h200_session.sh sources                # copies beside resident compute, by the host memory they read
#                                                # (bench/copy_sources.py)
#   bench/h200_session.sh timeline               # where the 12-of-24 row's time goes (bench/gpu_timeline.py;
#                                                # MODES=resident_act,resident_copies_act,budget_12_of_24_act:4.8699:
#                                                # the row's kernels beside its floor's, COPY_GIB a copy),
#                                                # then that row interleaved with resident (PAIRS=12), and
#                                                # every offload GPU test
# Install the carried wheels with --no-deps (pip --target resolves dependencies only among the
# wheels given, and the machine's own anyio etc. are not among them):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
# MUSUBI_FILE is musubi-tuner's src/musubi_tuner/modules/custom_offloading_utils.py (not shipped here).
# JSON lands in $OUT (default ./h200-out) under the names bench/summarise_h200.py and bench/results/README.md
# use; each step has its own time limit inside one overall deadline.  WARMUP=N: untimed steps per
# segment of the interleaved rows (pair, rows; default 2).
set -u
OUT=${OUT:-./h200-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
deadline=$((SECONDS + ${BUDGET_S:-570}))
left() { echo $((deadline - SECONDS)); }
# kept_json FILE ERR: FILE stays if a run wrote it; otherwise ERR's tail says why, and no empty file comes back
kept_json() { [ -s "$1" ] && return; tail -3 "$2"; rm -f "$1"; return 1; }
# rotated NAME CMD...: PROCS processes of a rotated bench (three sides a round), while 170 s are left;
# each one's JSON in $OUT/NAME_rI_h200.json (its last line: musubi-tuner prints one of its own), its
# log in /tmp (at most 8 files come back), its rounds printed, and the log's tail when no JSON came
rotated() {
  local name=$1 i json err; shift
  for i in $(seq "${PROCS:-3}"); do
    [ "$(left)" -ge 170 ] || break
    json=$OUT/${name}_r${i}_h200.json; err=/tmp/${name}_r$i.err
    timeout "${ROW_S:-200}" "$@" 2> "$err" | tail -n 1 > "$json"
    echo "process $i:"; grep "^round" "$err"
    kept_json "$json" "$err"  # no empty file to come back or be pooled
  done
}
case "$1" in
benches)
  nvidia-smi --query-gpu=name,memory.used,memory.total,pcie.link.gen.current,pcie.link.width.current \
    --format=csv > "$OUT/gpu.txt" 2>&1
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/core/offload/test_offload_gpu.py \
    > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
  timeout 170 python3 -m bench.side_by_side --musubi-file "$2" --out "$OUT/side_by_side_h200.json" > /dev/null
  timeout "$(left)" python3 -m bench.offload --cases optim,qwen20b,fp8_loss,determinism \
    --out "$OUT/offload_h200.json" > /dev/null
  ;;
interleave)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/offload/test_optimizer_state_gpu.py \
    > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
  timeout "${SBS_S:-240}" python3 -m bench.side_by_side --musubi-file "$2" --rows budget_12_of_24_act \
    --interleave "${INTERLEAVE:-budget_12_of_24_act}" ${COPIES:+--copies} --pairs "${PAIRS:-6}" --out "$OUT/side_by_side_interleaved_h200.json" > /dev/null
  [ "${OPTIM:-1}" = 0 ] || timeout "$(left)" python3 -m bench.offload --cases optim \
    --out "$OUT/offload_optim_gpustep_h200.json" > /dev/null
  ;;
diagnose)
  # the 12-of-24 row taken apart, one process per mode (bench/interleaved.py's diagnoses; 75-110 s each)
  for m in ${MODES:-resident_copies resident_copies_arena static_12_of_24_samecopy static_12_of_24_timed}; do
    [ "$(left)" -ge 120 ] || break
    timeout 170 python3 -m bench.interleaved --mode "$m" --budget-gib "${BUDGET_GIB:-2.6374}" --copy-gib 0.2110 \
      --pairs "${PAIRS:-8}" > "$OUT/interleaved_${m}_h200.json" 2> "$OUT/$m.err"; tail -1 "$OUT/$m.err"
  done
  ;;
pair)
  timeout 190 python3 -m bench.musubi_harness --musubi-file "$2" --blocks-to-swap "${SWAP:-12}" --pairs "${PAIRS:-6}" \
    --steps 8 --warmup "${WARMUP:-2}" 2> /tmp/musubi.err | tail -n 1 > "$OUT/musubi_interleaved_${SWAP:-12}_h200.json"
  # the log stays out of $OUT, as in three and rows (at most 8 files come back); its last line is the result's
  kept_json "$OUT/musubi_interleaved_${SWAP:-12}_h200.json" /tmp/musubi.err && tail -1 /tmp/musubi.err
  timeout "$(left)" python3 -m bench.interleaved --mode budget_12_of_24_act --budget-gib "${BUDGET_GIB:-4.8699}" \
    --pairs "${PAIRS:-6}" --steps 8 --warmup "${WARMUP:-2}" ${CLOCKS:+--clocks} > "$OUT/interleaved_budget_12_of_24_act_h200.json" \
    2> /tmp/interleaved.err
  grep "^pair" /tmp/interleaved.err
  kept_json "$OUT/interleaved_budget_12_of_24_act_h200.json" /tmp/interleaved.err
  ;;
three)
  rotated "three_way${SWAP:+_swap$SWAP}" python3 -m bench.musubi_harness --musubi-file "$2" \
    --blocks-to-swap "${SWAP:-12}" --ours "${MODE:-budget_12_of_24_act}" --budget-gib "${BUDGET_GIB:-4.8699}" \
    --pairs "${ROUNDS:-12}" --steps 8 --warmup "${WARMUP:-2}"
  ;;
floor)
  rotated "floor_${MODE:-budget_12_of_24_act}${TAG:+_$TAG}" python3 -m bench.interleaved \
    --mode "${MODE:-budget_12_of_24_act}" --floor "${FLOOR:-plain}" --budget-gib "${BUDGET_GIB:-4.8699}" \
    --copy-gib "${COPY_GIB:-0.1758}" --pairs "${ROUNDS:-12}" --steps 8 --warmup "${WARMUP:-2}" ${CLOCKS:+--clocks}
  ;;
rows)
  i=0
  for run in ${RUNS:?}; do
    m=${run%@*}; gib=${run#*@}; i=$((i + 1)); [ "$(left)" -ge 100 ] || break
    json=$OUT/interleaved_${m}_${gib}_r${i}_h200.json
    err=/tmp/${m}_${gib}_r$i.err  # not in $OUT: at most 8 files come back; the pairs are printed
    timeout "${ROW_S:-150}" python3 -m bench.interleaved --mode "$m" --budget-gib "$gib" --pairs "${PAIRS:-6}" \
      ${CLOCKS:+--clocks} --steps 8 --warmup "${WARMUP:-2}" > "$json" 2> "$err"
    echo "$run (run $i):"; grep "^pair" "$err"
    kept_json "$json" "$err"
  done
  ;;
sources)
  timeout 200 python3 -m bench.copy_sources --rounds "${ROUNDS:-6}" --steps 5 > "$OUT/copy_sources_h200.json"
  ;;
timeline)
  # (--trace-dir: each profiled step's device events, brought back in one tar: at most 8 files come back)
  timeout 200 python3 -m bench.gpu_timeline --lead-steps "${LEAD_STEPS:-6}" --trace-dir /tmp/traces \
    --modes "${MODES:-resident,resident_act,budget_12_of_24_act:4.8546,static_12_of_24_act:2.6374}" --copy-gib "${COPY_GIB:-0.1758}" \
    > "$OUT/gpu_timeline_h200.json" 2> "$OUT/gpu_timeline.err"; tail -2 "$OUT/gpu_timeline.err"
  tar -C /tmp -cf "$OUT/traces.tar" traces
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -k "not nccl" tests/core/offload \
    > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
  timeout "$(left)" python3 -m bench.side_by_side --rows none --interleave budget_12_of_24_act \
    --pairs "${PAIRS:-12}" --out "$OUT/side_by_side_interleaved_h200.json" > /dev/null
  ;;
peak)
  timeout 60 python3 -m pytest -q -p no:cacheprovider -k "not nccl and not optimizer" \
    tests/core/offload/test_offload_gpu.py tests/core/gradient/test_activation_offload_gpu.py \
    > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
  if [ "${ROWS:-}" != none ]; then  # ROWS=none: only the Qwen-Image rows
    timeout 150 python3 -m bench.side_by_side --musubi-file "$2" --out "$OUT/side_by_side_peak_h200.json" \
      --rows "${ROWS:-streamed,fp8_streamed,streamed_act,budget_12_of_24_act}" > /dev/null
  fi
  if [ "$(left)" -ge 170 ]; then  # resident + fp8 under 16 GB: 12 steps, 60-80 s a row on the H200
    timeout "$(left)" python3 -m bench.offload --cases widen,qwen20b --qwen-rows "${QWEN_ROWS:-fp8_budget_16gb}" \
      --profile-step "${PROFILE_STEP:-0}" \
      --out "$OUT/offload_fp8_16gb_h200.json" > /dev/null
  fi
  ;;
optim)  # issue 12's optimizer-offload toy and the optimizer-offload GPU tests
  lscpu > "$OUT/cpu.txt" 2>&1; python3 -c "import torch; print('intra-op threads', torch.get_num_threads())"
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/core/offload/test_offload_gpu.py \
    -k "bound_optimizer or fp32_toy or budget" > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
  timeout "$(left)" python3 -m bench.offload --cases optim --out "$OUT/offload_optim_h200.json"
  ;;
compiled)  # block inputs offloaded by keyword (Qwen-Image) beside compiled blocks, fused AdamW; the GPU tests
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/gradient/test_activation_offload_gpu.py \
    tests/core/training/test_compile.py > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
  rows=resident_compiled,budget_24gb_act_compiled,budget_24gb_compiled,fp8_budget_16gb_compiled
  rows=$rows,resident_compiled_fused,budget_24gb_act_compiled_fused
  timeout "$(left)" python3 -m bench.offload --cases qwen20b --skip-resident --qwen-rows "${QWEN_ROWS:-$rows}" \
    --out "$OUT/offload_compiled_act_h200.json" > "$OUT/offload_log.txt" 2>&1; tail -3 "$OUT/offload_log.txt"
  ;;
bound)  # the Qwen-Image 24 GB rows beside their floor under any schedule (lower_bound), the gradient GPU tests
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/gradient > "$OUT/gpu_tests.txt" 2>&1
  tail -3 "$OUT/gpu_tests.txt"
  timeout "$(left)" python3 -m bench.offload --cases qwen20b --skip-resident \
    --qwen-rows "${QWEN_ROWS:-resident_compiled,budget_24gb_act_compiled,budget_24gb_compiled}" \
    --out "$OUT/offload_bound_h200.json" > "$OUT/offload_log.txt" 2>&1; tail -3 "$OUT/offload_log.txt"
  ;;
narrow)  # LoRA adapters saving their bf16 input (training/adapter_inputs.py), block inputs offloaded by keyword
  timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/training/test_adapter_inputs.py \
    tests/core/gradient/test_activation_offload_gpu.py > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
  timeout 200 python3 -m bench.side_by_side --musubi-file "$2" --rows "${ROWS:-streamed_act,budget_12_of_24_act}" \
    --out "$OUT/side_by_side_narrow_h200.json" > /dev/null
  timeout 90 python3 -m bench.side_by_side --lora-input fp32 --rows streamed_act \
    --out "$OUT/side_by_side_fp32in_h200.json" > /dev/null
  timeout "$(left)" python3 -m bench.offload --cases qwen20b --skip-resident \
    --qwen-rows "${QWEN_ROWS:-resident_compiled,budget_24gb_act_compiled}" \
    --out "$OUT/offload_narrow_h200.json" > "$OUT/offload_log.txt" 2>&1; tail -3 "$OUT/offload_log.txt"
  ;;
hoststate|bwdstep)  # the optimizer state off the GPU: offload.optimizer_state_on_host (hoststate) or
  # StepInBackward (bwdstep): GPU tests, stack rows with and without musubi's (hoststate: QWEN_ROWS after them)
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/offload/test_optimizer_state_gpu.py \
    > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
  # SKIP_NONFINITE=1: bwdstep rows as offload.optimizer_step_in_backward runs them in the Trainer
  rows=${ROWS:-streamed_act,streamed_act_$1,budget_12_of_24_act,budget_12_of_24_act_$1}
  timeout 200 python3 -m bench.side_by_side --musubi-file "$2" --rows "$rows" ${SKIP_NONFINITE:+--skip-nonfinite} \
    --out "$OUT/side_by_side_$1_h200.json" > /dev/null
  timeout 150 python3 -m bench.side_by_side --rows "$rows" ${SKIP_NONFINITE:+--skip-nonfinite} \
    --out "$OUT/side_by_side_$1_b_h200.json" > /dev/null
  if [ "$1" = hoststate ] && [ -n "${QWEN_ROWS:-}" ]; then
    timeout "$(left)" python3 -m bench.offload --cases qwen20b --skip-resident --qwen-rows "$QWEN_ROWS" \
      --out "$OUT/offload_hoststate_h200.json" > "$OUT/offload_log.txt" 2>&1; tail -3 "$OUT/offload_log.txt"
  fi
  ;;
e2e)
  timeout "$(left)" python3 -m bench.e2e_gpu --workdir /tmp/splitflow-e2e --out "$OUT/e2e_full_h200.json" \
    --set offload.vram_budget_gb=22.35 > "$OUT/e2e_log.txt" 2>&1; tail -5 "$OUT/e2e_log.txt"
  ;;
packed)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -k "not nccl" tests/core/offload/test_packed_gpu.py \
    tests/core/offload/test_widening.py tests/core/offload/test_offload_gpu.py > "$OUT/gpu_tests.txt" 2>&1
  tail -3 "$OUT/gpu_tests.txt"
  timeout 60 python3 -m bench.offload --cases widen --out "$OUT/widen_h200.json" > /dev/null
  timeout "$(left)" python3 -m bench.offload --cases optim --out "$OUT/offload_optim_h200.json" > /dev/null
  ;;
packed20b)
  timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/offload/test_packed_gpu.py \
    > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
  timeout 60 python3 -m bench.offload --cases widen --out "$OUT/widen_h200.json" > /dev/null
  timeout "$(left)" python3 -m bench.offload --cases qwen20b --qwen-steps 12 --qwen-rows \
    "${QWEN_ROWS:-resident_compiled,packed_budget_24gb_compiled,packed_budget_24gb,fp8_budget_16gb_compiled}" \
    --out "$OUT/offload_packed_24gb_h200.json" > /dev/null
  ;;
esac
python3 bench/summarise_h200.py "$OUT"
