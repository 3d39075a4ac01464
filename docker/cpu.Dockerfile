# CPU image that runs `peagle demo` (and the test suite). Build from the repository root:
#   docker build -f docker/cpu.Dockerfile -t peagle-cpu:0.1.0 .
#   docker run --rm -v "$PWD/demo:/out" peagle-cpu:0.1.0 demo --target tiny --out /out/demo --cache-dir /out/cache
# Build arguments (defaults: the official Python image, PyPI and the PyTorch CPU index):
#   BASE        any image with Python 3.11 and its venv module (python3 -m venv), e.g. a Debian bookworm
#   INDEX_URL, EXTRA_INDEX_URL   where pip finds the lock's wheels
#   FIND_LINKS  a wheelhouse URL: install from it alone, no index (a build that cannot reach one;
#               scripts/check_images.py serves `pip download --no-deps -r locks/base.txt` on 127.0.0.1)
ARG BASE=python:3.11.11-slim-bookworm

FROM ${BASE} AS build
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
ARG EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG FIND_LINKS=
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
    PEAGLE_CACHE_DIR=/home/peagle/.cache/peagle PATH=/opt/peagle/bin:$PATH
COPY --from=build /wheels /wheels
# The versions the test suite passed with (locks/base.txt, torch as the CPU build); --no-deps: the
# lock is the whole closure, nothing is resolved at build time. A venv: the base's own Python stays
# as it is (Debian's refuses system-wide pip installs).
COPY locks/base.txt /tmp/base.txt
RUN if [ -n "$FIND_LINKS" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS="$FIND_LINKS"; fi \
 && python3 -m venv /opt/peagle \
 && pip install --no-cache-dir --no-deps --index-url "$INDEX_URL" --extra-index-url "$EXTRA_INDEX_URL" -r /tmp/base.txt \
 && pip install --no-cache-dir --no-deps /wheels/*.whl \
 && rm -rf /wheels /tmp/base.txt
RUN useradd --create-home --uid 10001 peagle
USER 10001
WORKDIR /home/peagle
ENTRYPOINT ["peagle"]
CMD ["demo"]
