# Extraction image for GPU inference boxes: peagle on the official vLLM image (CUDA, vLLM pinned).
#   docker build -f docker/extract.Dockerfile -t peagle-extract:0.1.0 .
#   docker run --gpus all --shm-size 16g -v /models:/models -v /store:/store peagle-extract:0.1.0 \
#     extract --data /store/chat.jsonl --target /models/target --out /store/s --backend vllm
FROM python:3.12.8-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY peagle ./peagle
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM vllm/vllm-openai:v0.32.0
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
COPY --from=build /wheels /wheels
# Only peagle's own light dependencies are added: torch, transformers and vLLM stay the image's.
RUN pip install --no-cache-dir /wheels/*.whl typer==0.20.0 pyarrow==22.0.0 \
 && rm -rf /wheels
RUN useradd --create-home --uid 10001 peagle
USER 10001
WORKDIR /home/peagle
ENTRYPOINT ["peagle"]
CMD ["--help"]
