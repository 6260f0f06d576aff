# syntax=docker/dockerfile:1
# One image for every gpupack component:
#   gpupack extender | gpupack device-plugin | gpupack defrag | gpupack status | python -m gpupack.certs
#
# Base image pinned by exact tag. Pin it by digest too where your registry policy asks for it:
#   docker buildx imagetools inspect python:3.11.11-slim-bookworm   (then PYTHON_IMAGE=...@sha256:...)
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
# The version is the release pyproject.toml names ([project] version); GPUPACK_VERSION only labels
# the image (org.opencontainers.image.version), e.g. --build-arg GPUPACK_VERSION=0.2.0.
ARG GPUPACK_VERSION=""

# --- build: install gpupack and its dependencies into a virtualenv --------------------------------
FROM ${PYTHON_IMAGE} AS build
ARG GPUPACK_VERSION
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/gpupack
WORKDIR /src
# Dependencies first, so that a code change does not re-download them.
COPY pyproject.toml README.md LICENSE ./
RUN mkdir -p gpupack deviceplugin extender \
 && touch gpupack/__init__.py deviceplugin/__init__.py extender/__init__.py \
 && /opt/gpupack/bin/pip install --prefer-binary . \
 && /opt/gpupack/bin/pip uninstall -y gpupack \
 && rm -rf gpupack deviceplugin extender build
COPY gpupack ./gpupack
COPY deviceplugin ./deviceplugin
COPY extender ./extender
COPY draplugin ./draplugin
RUN /opt/gpupack/bin/pip install --no-deps . \
 && /opt/gpupack/bin/gpupack --version \
 && /opt/gpupack/bin/python -m gpupack.certs --help >/dev/null
# No packaging tools at run time, in the virtualenv or in the base interpreter.
RUN for p in wheel setuptools pip; do \
      if /opt/gpupack/bin/python -m pip show -q "$p" >/dev/null 2>&1; then /opt/gpupack/bin/python -m pip uninstall -y -q "$p"; fi; \
    done

# --- runtime: the virtualenv on a clean base, no compilers, no pip --------------------------------
FROM ${PYTHON_IMAGE}
ARG GPUPACK_VERSION
LABEL org.opencontainers.image.title="gpupack" \
      org.opencontainers.image.version="${GPUPACK_VERSION}" \
      org.opencontainers.image.description="GPU sharing for Kubernetes: scheduler extender, device plugin, defragmenter" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN for p in wheel setuptools pip; do \
      if python -m pip show -q "$p" >/dev/null 2>&1; then python -m pip uninstall -y -q "$p"; fi; \
    done \
 && groupadd --system --gid 65532 gpupack \
 && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent gpupack
COPY --from=build /opt/gpupack /opt/gpupack
ENV PATH=/opt/gpupack/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
# Non-root by default. The device plugin DaemonSet overrides this with runAsUser: 0 because the
# kubelet's device-plugin directory is root-owned; nothing else needs root.
USER 65532:65532
CMD ["gpupack", "--help"]
