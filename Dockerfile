# omni_tts server images, two targets of one base (docs/deploy.md):
#   docker build --target cpu -t omni-tts:cpu .     # CPU torch; serves the embedded tiny model unless given --model
#   docker build --target cuda -t omni-tts:cuda .   # CUDA 13.0 torch; serves Qwen3-TTS-12Hz-1.7B-CustomVoice on one GPU
# The server is installed as a wheel; arguments after the image name replace the CMD (model and stage config):
#   docker run --gpus all -p 8000:8000 omni-tts:cuda --model /models/DIR --stage-config qwen3_tts_1gpu
ARG PYTHON_VERSION=3.12

FROM python:${PYTHON_VERSION}-slim AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY omni_tts ./omni_tts
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM python:${PYTHON_VERSION}-slim AS base
# torch ≥ 2.11 runs omni_tts; 2.11.0 is the one the GPU figures in docs/benchmarks.md were measured with
ARG TORCH_VERSION=2.11.0
ENV TORCH_VERSION=${TORCH_VERSION} PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
# a numeric user, so that Kubernetes' runAsNonRoot can verify it; its home holds the Hugging Face cache
RUN useradd --create-home --uid 1000 --user-group omni
COPY --from=wheel /dist /dist
WORKDIR /home/omni
EXPOSE 8000
# /health answers 200 once both stages are up, 503 while the model loads or a stage restarts
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["omni-tts", "serve", "--host", "0.0.0.0", "--port", "8000"]

FROM base AS cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu \
    && pip install /dist/omni_tts-*.whl && rm -rf /dist
USER 1000
CMD []

FROM base AS cuda
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cu130 \
    && pip install /dist/omni_tts-*.whl && rm -rf /dist
USER 1000
CMD ["--model", "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice", "--stage-config", "qwen3_tts_1gpu"]
