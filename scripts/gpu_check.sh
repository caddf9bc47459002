#!/usr/bin/env bash
# One-GPU check of lowband's CUDA/NCCL paths (run through the device tool; never part of CI).
#
#   OUT=/some/dir bash scripts/gpu_check.sh [STEPS]
#
# Runs under the machine's own python3/torch (PYTHONPATH=. , no install). Each part has its own time cap,
# so one hang costs only that part. Writes $OUT/log (everything), $OUT/train.tsv (strategy, final train
# loss, tokens/s, peak memory), and the bench suites' JSON/Markdown ($OUT/*.json, *.md).
#   0. scripts/gpu_parity.py: every wire codec bitwise equal on CUDA and CPU, AdamW / Muon CUDA vs CPU;
#   1. the trainer on cuda, one NCCL rank (torchrun --nproc_per_node 1), every strategy for STEPS steps;
#   2. python -m lowband.bench rekls / dp / gtp with --device cuda (one rank: the optimizer-step and
#      kernel times; no inter-GPU traffic on one GPU).
set -uo pipefail
OUT=${OUT:?set OUT to an output folder}
STEPS=${1:-30}
DEVICE=${DEVICE:-cuda}          # DEVICE=cpu PARTS=train tries the trainer part on a CPU machine
PARTS=${PARTS:-"parity train rekls dp gtp"}  # which parts run; TRAIN_TIMEOUT (s, default 75) caps each trainer run
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD:$PWD/scripts/gpu_compat PYTHONUNBUFFERED=1  # gpu_compat: DDP kwarg on torch < 2.13
PY=${PY:-python3}
log() { echo "=== $(date +%T) $*"; }
want() { [[ " $PARTS " == *" $1 "* ]]; }

{
log env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'

run_train() {  # NAME, overrides...
  want train || return 0
  local name=$1; shift
  log "train $name"
  timeout "${TRAIN_TIMEOUT:-75}" $PY -m torch.distributed.run --standalone --nproc_per_node 1 -m lowband.train \
    --config configs/demo.toml --run.device="$DEVICE" --run.world_size=1 --run.steps="$STEPS" \
    --run.log_every=10 --run.val_every=0 --run.name="gpu-$name" --run.out_dir="$OUT/runs" "$@"
  local rc=$?
  local loss tps mem
  loss=$($PY -c "import json,sys; d=json.load(open('$OUT/runs/gpu-$name/summary.json')); print(d.get('final_loss'), d.get('tokens_per_s'), d.get('peak_mem_bytes'))" 2>/dev/null)
  printf '%s\t%s\t%s\n' "$name" "$rc" "$loss" >> "$OUT/train.tsv"
}

want parity && { log parity; timeout 120 $PY scripts/gpu_parity.py; }

run_train single --strategy.name=single
run_train ddp --strategy.name=ddp --sparse.tables=[]
run_train sharded-adamw --strategy.name=sharded-adamw
run_train sharded-adamw-fp8 --strategy.name=sharded-adamw --strategy.grad_wire_dtype=fp8 --sparse.tables=[]
run_train sharded-muon --strategy.name=sharded-muon
run_train gtp-fp8 --strategy.name=gtp --gtp.gather=fp8 --sparse.tables=[]
run_train gtp-muon --strategy.name=gtp --gtp.optimizer=muon --sparse.tables=[]
run_train tp-rekls --strategy.name=tp --tp.size=1 --tp.optimizer=rekls --model.bigram_rows=0 --sparse.tables=[]
run_train diloco --strategy.name=diloco --diloco.num_replicas=1 --diloco.wire=topk-int2 --sparse.tables=[]

want rekls && {
log "bench rekls"
timeout 100 $PY -m torch.distributed.run --standalone --nproc_per_node 1 -m lowband.bench rekls --device cuda \
  --shapes 2048x2048:0,4096x1024:0,1024x4096:1 --repeats 5 --warmup 2 --out "$OUT/rekls-cuda.json"
}
want dp && {
log "bench dp"
timeout 130 $PY -m torch.distributed.run --standalone --nproc_per_node 1 -m lowband.bench dp --device cuda \
  --n-layer 8 --n-embd 1024 --n-head 8 --seq-len 256 --batch-size 8 --vocab-size 32000 \
  --contenders ddp,sharded-adamw,sharded-adamw-fp8,sharded-muon,zero,fsdp2,ddp-muon,fsdp2-muon \
  --repeats 5 --warmup 2 --out "$OUT/dp-cuda.json"
}
want gtp && {
log "bench gtp"
timeout 130 $PY -m torch.distributed.run --standalone --nproc_per_node 1 -m lowband.bench gtp --device cuda \
  --n-layer 8 --n-embd 1024 --n-head 8 --seq-len 256 --batch-size 8 --vocab-size 32000 \
  --repeats 5 --warmup 2 --out "$OUT/gtp-cuda.json"
}
log done
} 2>&1 | tee "$OUT/log"
