#!/usr/bin/env bash
# The GPU items of issue 12 in one call of the lent GPU machine (PyTorch + Triton,
# no registry, no TE/flash-attn/apex), from the repo root, writing to $OUT:
#
#   here:  benchmarks/device/prepare.sh MEGATRON_LM_GIT_DIR     (once: fills .gpu/)
#   there: bash benchmarks/device/checks.sh [PART ...]           (carry: .gpu)
#
# Sized for a lease of 15 minutes of device time, the machine's start (1-2 min)
# included: two calls, the second at once on the still-warm machine (it is given
# back 30 s after a call):
#   run(command="bash benchmarks/device/checks.sh", carry=[".gpu"], kind="nvidia-h200",
#       timeout_s=540)                  # the targets, then the gpu tests (DEADLINE 480 s)
#   run(command="DEADLINE=200 bash benchmarks/device/checks.sh PART ...", carry=[".gpu"],
#       timeout_s=240)                  # what the first skipped (its last line names them)
#
# Measured on the H200 in session 44: smoke 45 s, small 100 s, h2048 100 s (the start
# and the compiles: 100 timed steps take 2-4 s), the `gpu` tests ~450 s in all (46 of
# them 216 s; the launches of tests/benchmarks and tests/train/test_runs.py 30-100 s
# each): all of them do not fit beside the targets in one lease. Where both are due,
# call 1 "DEADLINE=260 ... small h2048" and call 2 at once "SMOKE=skip DEADLINE=330
# TESTS='tests --deselect ...' ... tests" with what is due of the tests.
#
# PARTs, in this order by default: the targets still unmet and the gpu tests first
# (session 26 measured paper and mlm: met), each under its own time limit, cut to
# what is left of DEADLINE seconds from the start; a part with under 60 s left is
# skipped and says so:
#   small   benchmarks/step.py configs/bench/small.yaml, torch backend      -> step-small.json
#           with each arm's allocator history, read by benchmarks/peak_memory.py
#           --snapshots (what is alive at each arm's peak) -> peak-small.json
#           (small, h2048 and paper add one profiled step per arm: --profile)
#   h2048   benchmarks/step.py configs/bench/h2048.yaml, torch backend      -> step-h2048.json
#   paper   the paper's 1.5B shape, torch backend (LAYERS of its 28 layers;
#           default 28 on a card of > 120 GiB, else 12), micro 4, global 8   -> step-paper.json
#   mlm     Megatron-LM's pretrain_gpt.py on the same shape, batch and card
#           (--transformer-impl local, mock data, tied embeddings as the config)
#   tests   the `gpu` tests (pytest -m gpu)                      -> checks.log, tests.xml
#   kernel  benchmarks/shift_kernel.py --qkv at the h2048 shape, bf16: the shift's own
#           time against vanilla's split, per kernel                       -> checks.log
#           the same with RoPE: the split, shift and RoPE as one node (qkv_rope) per arm
#           benchmarks/cross_entropy.py at the paper's logits (8192 x 36000, bf16):
#           megatron's loss against the fused one                  -> cross-entropy.json
#           benchmarks/swiglu.py at the paper's MLP (8192 x 2 x 5504, bf16): torch's
#           ops against the Triton kernels                                -> swiglu.json
#   kernels the small shape with the shift on torch ops instead of Triton, h2048 with
#           megatron's RoPE instead of the Triton kernel (what the Triton RoPE, in the
#           QKV split node since session 8, gains both arms),
#           and configs/bench/host.yaml (a host-bound step) with each shift kernel:
#           which one a launch-bound step should take -> step-small-torchops.json,
#           step-h2048-ropetorch.json, step-host-{triton,torchops}.json
# First benchmarks/device/smoke.py compiles and runs each Triton kernel once; one that
# fails is turned off (--set ...=torch) for the timed runs, said in checks.log and
# $OUT/smoke.txt. Everything printed goes to $OUT/checks.log; $OUT/env.txt says what ran where, and
# $OUT/summary.txt (benchmarks/device/summary.py) puts each target beside its goal.
# The JSON and XML records come back in $OUT/results.tgz (a call brings back 8 files
# at most); here, `python benchmarks/device/summary.py CALL1 CALL2` gives the table of
# both calls from their folders as they came back.
set -u
: "${OUT:?set OUT to the folder that comes back}"
DEADLINE=${DEADLINE:-480}
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(small h2048 tests paper mlm kernel kernels)
start=$(date +%s)
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/checks.log"; }

# run NAME LIMIT CMD...: CMD under LIMIT seconds (or what is left of DEADLINE),
# its output into checks.log
run() {
  local name=$1 limit=$2 left
  shift 2
  left=$((DEADLINE - ($(date +%s) - start)))
  if [ "$left" -lt 60 ]; then
    skipped+=("$name"); log "$name: skipped (${left}s left of DEADLINE ${DEADLINE}s)"; return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  log "$name (limit ${limit}s): $*"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/checks.log" | tail -n 25
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || failed+=("$name")
  log "$name: exit $rc after $(( $(date +%s) - start ))s"
}
failed=() skipped=()

for whl in megatron_core-0.16.1 pydantic-2; do  # pydantic: Megatron-LM's pretrain_gpt.py
  ls .gpu/whl/$whl*.whl >/dev/null 2>&1 \
    || { echo "checks.sh: .gpu/whl has no ${whl%%-[0-9]*} wheel: run benchmarks/device/prepare.sh here and carry .gpu"; exit 2; }
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .gpu/whl/*.whl || exit 2
# Megatron-LM's start-up runs `make` in megatron/core/datasets; the wheel ships the
# built helpers but no Makefile, and a failed make ends the run: a no-op target.
printf 'all:\n\t@true\n' > /tmp/site/megatron/core/datasets/Makefile
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 WANDB_MODE=offline
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  python3 -c 'import sys, torch, triton, megatron.core as m; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "megatron-core", m.__version__, "cuda", torch.version.cuda)'
  git log -1 --format='kvtrain %H %s' 2>/dev/null || true
  sed 's/^/megatron-lm core_v0.16.1 /' .gpu/megatron-lm/COMMIT 2>/dev/null
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# the Triton kernels have to compile here: one that fails is turned off for the
# timed runs (and the log says so) rather than failing every one of them
# (for 150 s at most: a kernel that hangs there is off, with every one not yet seen run)
# SMOKE=skip: a verdict of an earlier call on this card ("smoke-off:" alone: every kernel ran)
if [ "${SMOKE:-run}" = skip ]; then
  echo "smoke-off:" > "$OUT/smoke.txt"; log "smoke: skipped (SMOKE=skip): every kernel on"
else
  timeout 150 python3 benchmarks/device/smoke.py 2>&1 | tee -a "$OUT/checks.log" > "$OUT/smoke.txt"
  grep -q '^smoke-off:' "$OUT/smoke.txt" \
    || log "smoke.py hung or died: the kernels it did not see run are off"
fi
read -r -a off <<< "$(python3 benchmarks/device/smoke.py --verdict "$OUT/smoke.txt")"
[ ${#off[@]} -eq 0 ] || log "Triton kernels turned off for the timed runs: ${off[*]}"

# TESTS: the gpu tests to run (pytest node ids or files; default: all of tests/); each
# under TEST_TIMEOUT seconds (pytest-timeout, in the image), which prints the stacks of
# one that hangs
read -r -a tests <<< "${TESTS:-tests}"
test_timeout=()
python3 -c 'import pytest_timeout' 2>/dev/null && test_timeout=(--timeout "${TEST_TIMEOUT:-90}")

gib=$(python3 -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)' 2>/dev/null || echo 0)
LAYERS=${LAYERS:-$([ "$gib" -gt 120 ] && echo 28 || echo 12)}
paper=(--set model.num_layers="$LAYERS" --set train.micro_batch_size=4
       --set train.global_batch_size=8 --set train.peak_tflops_per_device=989)

for part in "${parts[@]}"; do
  case $part in
    tests) run tests 240 python3 -m pytest -v -rfE --tb=short -m gpu "${tests[@]}" \
             -p no:cacheprovider -o addopts= "${test_timeout[@]}" --junit-xml="$OUT/tests.xml" ;;
    kernel) run kernel 60 python3 benchmarks/shift_kernel.py --qkv --dtype bf16 --seq 2048 \
             --batch 4 --heads 16 --dim 128 --repeat 51
           run kernel-rope 60 python3 benchmarks/shift_kernel.py --qkv --rope --dtype bf16 \
             --seq 2048 --batch 4 --heads 16 --dim 128 --repeat 51
           if [[ " ${off[*]} " == *" model.cross_entropy_kernel=torch "* ]]; then
             log "cross-entropy: skipped (smoke turned the fused loss off)"
           else
             run cross-entropy 60 python3 benchmarks/cross_entropy.py \
               --json "$OUT/cross-entropy.json"
           fi
           if [[ " ${off[*]} " == *" model.swiglu_kernel=torch "* ]]; then
             log "swiglu: skipped (smoke turned the SwiGLU kernels off)"
           else
             run swiglu 60 python3 benchmarks/swiglu.py --json "$OUT/swiglu.json"
           fi ;;
    # 100 timed steps an arm (2 s at these shapes; the start and compiles take the rest):
    # on the H200 20 steps of h2048 spread 25.5-32.4 ms, a host-bound step's jitter
    # and the small shape's allocator history, each arm's, read at once (peak_memory.py:
    # what is alive at each peak) and dropped (tens of MB; the JSON comes back)
    small) run small 120 python3 benchmarks/step.py configs/bench/small.yaml --backend torch \
             "${off[@]}" --steps 100 --profile --memory-history "$OUT/memory" \
             --json "$OUT/step-small.json"
           run small-memory 60 python3 benchmarks/peak_memory.py --snapshots \
             "$OUT/memory/vanilla.pickle" "$OUT/memory/kv_shift.pickle" \
             --json "$OUT/peak-small.json"
           rm -rf "$OUT/memory" ;;
    h2048) run h2048 120 python3 benchmarks/step.py configs/bench/h2048.yaml --backend torch \
             "${off[@]}" --steps 100 --profile --json "$OUT/step-h2048.json" ;;
    paper) run "paper ($LAYERS layers)" 150 python3 benchmarks/step.py \
             configs/paper/1.5b_kv_shift.yaml --backend torch "${paper[@]}" "${off[@]}" --steps 8 \
             --warmup 2 --profile --json "$OUT/step-paper.json" ;;
    mlm)   run "megatron-lm ($LAYERS layers)" 150 env -C .gpu/megatron-lm torchrun \
             --nproc-per-node 1 pretrain_gpt.py --transformer-impl local \
             --num-layers "$LAYERS" --hidden-size 2048 --num-attention-heads 16 \
             --ffn-hidden-size 5504 --seq-length 2048 --max-position-embeddings 2048 \
             --position-embedding-type rope --rotary-base 100000 --swiglu \
             --normalization RMSNorm --disable-bias-linear --attention-dropout 0 \
             --hidden-dropout 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 36000 \
             --micro-batch-size 4 --global-batch-size 8 --bf16 --use-distributed-optimizer \
             --lr 2e-4 --min-lr 2e-4 --lr-warmup-iters 0 --weight-decay 0.1 --clip-grad 1.0 \
             --adam-beta2 0.95 --train-iters 20 --eval-iters 1 --eval-interval 1000 \
             --log-interval 5 \
             --log-throughput --no-gradient-accumulation-fusion --no-masked-softmax-fusion \
             --no-bias-swiglu-fusion --no-rope-fusion --no-persist-layer-norm ;;
    kernels)
           run small-torchops 100 python3 benchmarks/step.py configs/bench/small.yaml \
             --backend torch "${off[@]}" --set model.kv_shift.kernel=torch \
             --json "$OUT/step-small-torchops.json"
           run h2048-ropetorch 120 python3 benchmarks/step.py configs/bench/h2048.yaml \
             --backend torch "${off[@]}" --set model.rope_kernel=torch \
             --json "$OUT/step-h2048-ropetorch.json"
           for k in triton torch; do
             if [ "$k" = triton ] && [[ " ${off[*]} " == *" model.kv_shift.kernel=torch "* ]]; then
               log "host (triton): skipped (smoke turned the Triton shift off)"; continue
             fi
             run "host ($k)" 60 python3 benchmarks/step.py configs/bench/host.yaml \
               --backend torch "${off[@]}" --set model.kv_shift.kernel=$k --steps 200 \
               --warmup 10 \
               --json "$OUT/step-host-${k/torch/torchops}.json"
           done ;;
    *) log "unknown part $part (tests, kernel, small, h2048, paper, mlm, kernels)" ;;
  esac
done
# a call brings back 8 files at most: the records go into one archive, results.tgz
python3 benchmarks/device/summary.py --pack "$OUT" | tee "$OUT/summary.txt"
log "done after $(( $(date +%s) - start ))s; failed: ${failed[*]:-none}; skipped: ${skipped[*]:-none}"
[ ${#failed[@]} -eq 0 ]
