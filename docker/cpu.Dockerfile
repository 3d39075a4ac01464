# CPU image that runs `peagle demo` (and the test suite). Build from the repository root:
#   docker build -f docker/cpu.Dockerfile -t peagle-cpu:0.1.0 .
#   docker run --rm peagle-cpu:0.1.0            # runs the demo
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md constraints-cpu.txt ./
COPY peagle ./peagle
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
    PEAGLE_CACHE_DIR=/home/peagle/.cache/peagle
COPY --from=build /wheels /wheels
COPY constraints-cpu.txt /tmp/constraints-cpu.txt
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install --no-cache-dir -c /tmp/constraints-cpu.txt /wheels/*.whl \
 && rm -rf /wheels
RUN useradd --create-home --uid 10001 peagle
USER 10001
WORKDIR /home/peagle
ENTRYPOINT ["peagle"]
CMD ["demo"]
