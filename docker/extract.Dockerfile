# Extraction image for GPU inference boxes: peagle on the official vLLM image (CUDA, vLLM pinned).
#   docker build -f docker/extract.Dockerfile -t peagle-extract:0.1.0 .
#   docker run --gpus all --shm-size 16g -v /models:/models -v /store:/store peagle-extract:0.1.0 \
#     extract --data /store/chat.jsonl --target /models/target --out /store/s --backend vllm
# Build arguments: BASE (the image with torch, transformers and vLLM), BUILD_BASE (any Python with
# its venv module: builds peagle's wheel), INDEX_URL, FIND_LINKS (a wheelhouse URL: no index), as in
# docker/cpu.Dockerfile. scripts/check_images.py builds it on a stand-in BASE (docs/usage.md#docker).
ARG BASE=vllm/vllm-openai:v0.32.0
ARG BUILD_BASE=python:3.12.8-slim-bookworm

FROM ${BUILD_BASE} AS build
ARG INDEX_URL=https://pypi.org/simple
ARG FIND_LINKS=
WORKDIR /src
COPY locks/base.txt pyproject.toml README.md ./
COPY peagle ./peagle
# The lock's setuptools builds the wheel (--no-build-isolation: nothing else is fetched).
RUN if [ -n "$FIND_LINKS" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS="$FIND_LINKS"; fi \
 && python3 -m venv /tmp/venv \
 && /tmp/venv/bin/pip install --no-cache-dir --no-deps --index-url "$INDEX_URL" "$(grep '^setuptools==' base.txt)" \
 && /tmp/venv/bin/pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels .

FROM ${BASE}
ARG INDEX_URL=https://pypi.org/simple
ARG FIND_LINKS=
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
COPY --from=build /wheels /wheels
COPY locks/base.txt docker/constraints.py /tmp/
# Only peagle's own light dependencies are added, at the lock's versions: torch, transformers and vLLM
# (everything the image has) stay the image's (docker/constraints.py).
RUN if [ -n "$FIND_LINKS" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS="$FIND_LINKS"; fi \
 && python3 /tmp/constraints.py /tmp/base.txt > /tmp/constraints.txt \
 && python3 -m pip install --no-cache-dir --index-url "$INDEX_URL" -c /tmp/constraints.txt /wheels/*.whl \
 && rm -rf /wheels /tmp/base.txt /tmp/constraints.py /tmp/constraints.txt
RUN useradd --create-home --uid 10001 peagle
USER 10001
WORKDIR /home/peagle
ENTRYPOINT ["peagle"]
CMD ["--help"]
