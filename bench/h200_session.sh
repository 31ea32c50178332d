#!/usr/bin/env bash
# The GPU runs behind bench/results/, from the repository root on a CUDA machine (bench/README.md says what each
# prints):
#   bench/h200_session.sh tests                 # the GPU tests of the offload engine (pytest -m gpu)
#   bench/h200_session.sh offload               # Qwen-Image 20B budgets, optimizer offload, determinism
#   bench/h200_session.sh peers MUSUBI_FILE     # the LoRA stack against musubi-tuner's offloader, and against
#                                               # its own bytes moved by no engine (the floor)
#   bench/h200_session.sh e2e                   # splitflow run on a full-depth random Qwen-Image folder
#   bench/h200_session.sh preprocess            # stage 1 per family: images/s, GPU peak within the budget
#   bench/h200_session.sh train_step            # s/sample per batch size, FLUX.1-dev and Qwen-Image
#   bench/h200_session.sh ranks                 # on 2+ GPUs: offloaded torchrun training, 1 vs all ranks
#   bench/h200_session.sh edit                  # Qwen-Image-Edit-2509: the 20B DiT with a reference at 1024^2
#                                               # within 24 GB vs resident; stage 1 (2 refs at 1024^2, 1328^2 + 3 refs in 8 GiB)
#   bench/h200_session.sh ti2v                  # Wan2.2 TI2V-5B at 121x704x1280 within 24 GB vs resident, its
#                                               # stage 1 within 12 GiB
#   bench/h200_session.sh a14b                  # Wan2.2 T2V-A14B, both experts streamed in 24 GB (81x480x832)
#                                               # vs one expert resident
#   bench/h200_session.sh flux2 [ROWS]          # FLUX.2-dev within 24 GB, klein within 16 GB vs resident
#   bench/h200_session.sh flux2_preprocess      # FLUX.2-dev's 24 B Mistral (and klein 9B's Qwen3) within 8 GiB
# MUSUBI_FILE is musubi-tuner's src/musubi_tuner/modules/custom_offloading_utils.py (not shipped here).
# Install the carried wheels with --no-deps (pip --target resolves dependencies only among the wheels given):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
# JSON lands in $OUT (default ./h200-out); each step has its own time limit inside one deadline (BUDGET_S).
set -u
OUT=${OUT:-./h200-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
deadline=$((SECONDS + ${BUDGET_S:-570}))
left() { echo $((deadline - SECONDS)); }
# kept_json FILE ERR: FILE stays if a run wrote it; otherwise ERR's tail says why, and no empty file comes back
kept_json() { [ -s "$1" ] && return; tail -3 "$2"; rm -f "$1"; return 1; }
# rotated NAME CMD...: PROCS processes of a rotated bench (three sides a round), while 170 s are left; each
# one's JSON (its last stdout line) in $OUT/NAME_rI_h200.json, its log in /tmp, its rounds printed
rotated() {
  local name=$1 i json err; shift
  for i in $(seq "${PROCS:-2}"); do
    [ "$(left)" -ge 170 ] || break
    json=$OUT/${name}_r${i}_h200.json; err=/tmp/${name}_r$i.err
    timeout 200 "$@" 2> "$err" | tail -n 1 > "$json"
    echo "process $i:"; grep "^round" "$err"
    kept_json "$json" "$err"
  done
}
case "${1:-}" in
tests)
  timeout "$(left)" python3 -m pytest -q -p no:cacheprovider -m gpu -k "not nccl" tests/core/offload \
    tests/core/gradient tests/core/training > "$OUT/gpu_tests.txt" 2>&1; tail -3 "$OUT/gpu_tests.txt"
  ;;
offload)
  timeout "$(left)" python3 -m bench.offload --cases qwen20b,optim,determinism --qwen-steps 10 \
    --qwen-rows "${QWEN_ROWS:-packed_budget_24gb,resident_compiled,fp8_budget_16gb_compiled}" \
    --out "$OUT/offload_h200.json" > /dev/null
  ;;
peers)
  timeout 170 python3 -m bench.side_by_side --musubi-file "$2" --skip-nonfinite \
    --rows streamed_act_bwdstep,budget_12_of_24_act --out "$OUT/side_by_side_h200.json" > /dev/null
  # musubi-tuner swapping 13 blocks peaks at our 12-of-24 row's memory (4.4 GiB)
  rotated musubi_harness python3 -m bench.musubi_harness --musubi-file "$2" --blocks-to-swap 13 \
    --ours budget_12_of_24_act --budget-gib 4.8699 --pairs "${ROUNDS:-12}" --steps 8 --warmup 2
  rotated interleaved_floor python3 -m bench.interleaved --mode budget_12_of_24_act --floor plain \
    --budget-gib 4.8699 --copy-gib 0.1758 --pairs "${ROUNDS:-12}" --steps 8 --warmup 2
  ;;
e2e)
  timeout "$(left)" python3 -m bench.e2e_gpu --workdir /tmp/splitflow-e2e --out "$OUT/e2e_gpu_h200.json" \
    --set offload.vram_budget_gb=22.35 > "$OUT/e2e_log.txt" 2>&1; tail -5 "$OUT/e2e_log.txt"
  ;;
preprocess)
  timeout "$(left)" python3 -m bench.preprocess --images 16 --batch 16 --out "$OUT/preprocess_h200.json" > /dev/null
  ;;
train_step)
  for f in flux:FLUX.1-dev:512 qwen_image:Qwen-Image:128; do
    IFS=: read -r family variant text <<< "$f"
    timeout "$(left)" python3 bench/train_step.py --family "$family" --variant "$variant" --text-len "$text" \
      --device cuda --dtype bfloat16 --sizes 512,1024 --batch-size 1,2,4 --modes resident,offload --rank 32 \
      --steps 1 --warmup 1 --prefetch 2 --budget-s 50 > "$OUT/train_step_${family}_h200.json"
  done
  ;;
flux2)  # one worker process a row (dev's rows build 64 GB of random weights: a few minutes each)
  timeout "$(left)" python3 -m bench.offload --cases flux2 --qwen-steps 10 ${2:+--flux2-rows "$2"} \
    --out "$OUT/offload_flux2_h200.json" > /dev/null
  ;;
flux2_preprocess)
  timeout "$(left)" python3 -m bench.preprocess --families flux2:dev,flux2:klein-base-9b --images 16 --batch 16 \
    --steps throughput,memory,vae --out "$OUT/preprocess_flux2_h200.json" > /dev/null
  ;;
ranks)
  timeout "$(left)" python3 -m bench.ranks --workdir /tmp/ranks --dit-layers 16 --images 8 --pixels 1024 \
    --steps 12 --warmup 3 > "$OUT/ranks_h200x2.json"
  ;;
edit)
  timeout "$(left)" python3 bench/train_step.py --family qwen_image --spec-variant edit-2509 --variant Qwen-Image \
    --references 1 --text-len 256 --device cuda --dtype bfloat16 --sizes 1024 --modes offload,resident --rank 32 \
    --vram-budget-gb 24 --steps 4 --warmup 2 --out "$OUT/train_step_edit_h200.json" > /dev/null
  timeout "$(left)" python3 -m bench.preprocess --families qwen_image:edit-2509 --images 8 --batch 4 \
    --steps throughput,memory --out "$OUT/preprocess_edit_h200.json" > /dev/null
  ;;
ti2v)
  timeout "$(left)" python3 bench/train_step.py --family wan --spec-variant ti2v-5b --variant Wan2.2-TI2V-5B \
    --frames 121 --sizes 704x1280 --text-len 512 --device cuda --dtype bfloat16 --modes offload,resident --rank 32 \
    --vram-budget-gb 24 --steps 2 --warmup 1 --out "$OUT/train_step_ti2v_h200.json" > /dev/null
  timeout "$(left)" python3 -m bench.preprocess --families wan:ti2v-5b --steps memory \
    --out "$OUT/preprocess_wan22_h200.json" > /dev/null
  ;;
a14b)
  # both experts streamed within 24 GB (offload first: the process's host peak is its own), then one expert resident
  timeout "$(left)" python3 bench/train_step.py --family wan --spec-variant t2v-a14b --variant Wan2.2-T2V-A14B \
    --frames 81 --sizes 480x832 --text-len 512 --device cuda --dtype bfloat16 --modes offload --rank 32 \
    --vram-budget-gb 24 --steps 2 --warmup 1 --out "$OUT/train_step_a14b_offload_h200.json" > /dev/null
  timeout "$(left)" python3 bench/train_step.py --family wan --spec-variant t2v --variant Wan2.2-T2V-A14B \
    --frames 81 --sizes 480x832 --text-len 512 --device cuda --dtype bfloat16 --modes resident --rank 32 \
    --steps 2 --warmup 1 --out "$OUT/train_step_a14b_resident_h200.json" > /dev/null
  ;;
*)
  sed -n '2,20p' "$0"; exit 2
  ;;
esac
