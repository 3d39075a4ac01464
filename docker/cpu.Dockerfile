# CPU image that runs `peagle demo` (and the test suite). Build from the repository root:
#   docker build -f docker/cpu.Dockerfile -t peagle-cpu:0.1.0 .
#   docker run --rm peagle-cpu:0.1.0            # runs the demo
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY peagle ./peagle
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11.11-slim-bookworm
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
    PEAGLE_CACHE_DIR=/home/peagle/.cache/peagle
COPY --from=build /wheels /wheels
# The versions the test suite passed with (locks/base.txt, torch as the CPU build); --no-deps: the
# lock is the whole closure, nothing is resolved at build time.
COPY locks/base.txt /tmp/base.txt
RUN pip install --no-cache-dir --no-deps --extra-index-url https://download.pytorch.org/whl/cpu -r /tmp/base.txt \
 && pip install --no-cache-dir --no-deps /wheels/*.whl \
 && rm -rf /wheels /tmp/base.txt
RUN useradd --create-home --uid 10001 peagle
USER 10001
WORKDIR /home/peagle
ENTRYPOINT ["peagle"]
CMD ["demo"]
