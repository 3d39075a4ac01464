# Training image for GPU clusters: peagle on the official PyTorch CUDA runtime image.
#   docker build -f docker/train.Dockerfile -t peagle-train:0.1.0 .
#   docker run --gpus all --ipc host -v /store:/store -v /runs:/runs peagle-train:0.1.0 \
#     torchrun --nproc-per-node 8 -m peagle train --store /store/s --target /models/t --out /runs/r
# Build arguments: BASE (the image with torch), BUILD_BASE, INDEX_URL, FIND_LINKS, as in
# docker/extract.Dockerfile. scripts/check_images.py builds it on a stand-in BASE (docs/usage.md#docker).
ARG BASE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
ARG BUILD_BASE=python:3.11.11-slim-bookworm

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
# torch (and all else the image has) stays the image's; what peagle adds comes at the lock's versions.
RUN if [ -n "$FIND_LINKS" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS="$FIND_LINKS"; fi \
 && python3 /tmp/constraints.py /tmp/base.txt > /tmp/constraints.txt \
 && python3 -m pip install --no-cache-dir --index-url "$INDEX_URL" -c /tmp/constraints.txt /wheels/*.whl \
 && rm -rf /wheels /tmp/base.txt /tmp/constraints.py /tmp/constraints.txt
RUN useradd --create-home --uid 10001 peagle
USER 10001
WORKDIR /home/peagle
ENTRYPOINT []
CMD ["peagle", "--help"]
