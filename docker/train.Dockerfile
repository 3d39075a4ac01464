# Training image for GPU clusters: peagle on the official PyTorch CUDA runtime image.
#   docker build -f docker/train.Dockerfile -t peagle-train:0.1.0 .
#   docker run --gpus all --ipc host -v /store:/store -v /runs:/runs peagle-train:0.1.0 \
#     torchrun --nproc-per-node 8 -m peagle train --store /store/s --target /models/t --out /runs/r
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY peagle ./peagle
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
COPY --from=build /wheels /wheels
# torch comes from the base image; the constraint keeps pip from replacing it.
RUN python -c "import torch; print(f'torch=={torch.__version__.split(\"+\")[0]}')" > /tmp/torch-pin.txt \
 && pip install --no-cache-dir -c /tmp/torch-pin.txt /wheels/*.whl \
 && rm -rf /wheels /tmp/torch-pin.txt
RUN useradd --create-home --uid 10001 peagle
USER 10001
WORKDIR /home/peagle
ENTRYPOINT []
CMD ["peagle", "--help"]
