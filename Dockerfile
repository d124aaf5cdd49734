# syntax=docker/dockerfile:1
# Strata's image: the node daemon (strata serve), the weight node (strata weights serve) and the
# cache-aware router (strata route) in one image, run as uid 10001. What the Kubernetes manifests
# run (docs/deploy/kubernetes.md):
#
#   docker build -t strata:0.1.0 .                                  # CPU only (the default)
#   docker build -t strata:0.1.0-cuda --build-arg VARIANT=cuda \
#       --build-arg BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 .   # + a CUDA torch: the GPU tier (--gpu-bytes)
#   docker build --target engine -t strata-vllm:0.1.0 .             # vLLM with Strata's plugins (the engines)
#
# The suite lints this file (hadolint) and checks its structure against the settings and the
# manifests (tests/deploy/test_image.py); no CI machine has a Docker engine, so none builds it.

# The runtime's base: any image with a Python 3.11+ (python3) or apt-get to install one.
ARG BASE=python:3.11-slim-bookworm
# The engines' base: the vLLM release the vLLM tier and the model loader are written against.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0

# ---- the wheel -------------------------------------------------------------------------------
FROM python:3.11-slim-bookworm AS builder
WORKDIR /src
RUN pip install --no-cache-dir build==1.2.2.post1
COPY pyproject.toml README.md ./
COPY kvstore ./kvstore
COPY weightcache ./weightcache
RUN python -m build --wheel --outdir /dist .

# ---- the engines: vLLM with the LMCache plugin, the vLLM tier and the strata model loader -------
FROM ${VLLM_IMAGE} AS engine
COPY --from=builder /dist /tmp/dist
# vLLM's own torch and CUDA stay: the plugins need only Strata's client and LMCache.
RUN pip install --no-cache-dir "$(find /tmp/dist -name 'strata_kvcache-*.whl')[lmcache]" && rm -rf /tmp/dist

# ---- strata: daemon, weight node, router (the default target) ---------------------------------
FROM ${BASE} AS runtime
# cpu: no torch (the daemon needs none); cuda: a CUDA build of torch for the GPU tier.
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# A CUDA base has no Python 3.11+ of its own: take the distribution's (Ubuntu 24.04: 3.12).
# hadolint ignore=DL3008
RUN if ! python3 -c 'import sys, venv; assert sys.version_info >= (3, 11)' 2>/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --system --gid 10001 strata \
    && useradd --system --uid 10001 --gid strata --home-dir /var/lib/strata --create-home \
        --shell /usr/sbin/nologin strata
COPY --from=builder /dist /tmp/dist
# router: strata route (aiohttp, the tokenizer); redis: the index's C reply parser.
RUN python3 -m venv /opt/strata \
    && if [ "$VARIANT" = cuda ]; then \
        /opt/strata/bin/pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION"; \
    elif [ "$VARIANT" != cpu ]; then \
        echo "VARIANT is cpu or cuda, not $VARIANT" >&2; exit 1; \
    fi \
    && /opt/strata/bin/pip install --no-cache-dir "$(find /tmp/dist -name 'strata_kvcache-*.whl')[router,redis]" \
    && rm -rf /tmp/dist \
    && /opt/strata/bin/strata --version
ENV PATH=/opt/strata/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1
USER 10001:10001
WORKDIR /var/lib/strata
# gRPC (strata serve --listen), the peer data plane (--peer-listen), the daemon's metrics, the
# weight node and its metrics, the router. Each listens on loopback unless told otherwise, and
# beyond loopback only with authentication (protected mode).
EXPOSE 50051 50061 9464 7460 9465 8000
# Docker's health check would fit one of the three commands only; Kubernetes ignores it anyway.
# The manifests probe each: gRPC health for the daemon, TCP for the weight node, GET /health for
# the router.
HEALTHCHECK NONE
ENTRYPOINT ["strata"]
CMD ["serve"]
