# syntax=docker/dockerfile:1
# gpuguard's image: `gpuguard serve` as a non-root user on a slim Python, with exactly the dependency
# versions of constraints.txt (regenerate it with `python scripts/constraints.py`). From the repo root:
#   docker build -t registry.example.com/gpuguard:0.1.0 .
# For reproducible builds, pin the base by digest in CI: --build-arg PYTHON_IMAGE=python:3.11-slim@sha256:...
ARG PYTHON_IMAGE=python:3.11-slim

# --- build: the wheel and a virtualenv with everything gpuguard needs at run time ----------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY webhook/ webhook/
# The build backend is pinned too, and used without build isolation so that this pin is what builds.
RUN python -m pip install "setuptools==80.9.0" \
 && python -m pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .
# A virtualenv without pip, filled from outside it: binary wheels only (the slim image has no compiler,
# and none is needed), every version from constraints.txt.
# Its bytecode is compiled again, checked by the source's hash rather than its modification time: an image
# layer may round a file's time (buildah's does, by up to a second), and a module whose bytecode looks
# stale is compiled from source at every start (the Kubernetes client's CoreV1Api alone: 4 MB of source,
# 80 MB of memory, past the node agent's limit). The root filesystem is read-only: nothing is rewritten.
RUN python -m venv --without-pip /opt/gpuguard \
 && python -m pip --python /opt/gpuguard/bin/python install --only-binary=:all: --no-compile \
      --constraint constraints.txt /wheels/gpuguard-*.whl \
 && python -m compileall -q -j 0 --invalidation-mode unchecked-hash /opt/gpuguard/lib

# --- run: the same Python, the virtualenv, nothing to build or install with ----------------------------
FROM ${PYTHON_IMAGE}
RUN python -m pip uninstall --yes pip setuptools wheel \
 && install -d -o 65532 -g 65532 /var/run/gpuguard
COPY --from=build /opt/gpuguard /opt/gpuguard
ENV PATH=/opt/gpuguard/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# Writable by gpuguard for a plain `docker run` (certificates go to ./certs); in Kubernetes the root
# filesystem is read-only and --cert-dir points at an in-memory emptyDir instead.
WORKDIR /var/run/gpuguard
# 65532: the conventional "nonroot" user; the Deployment insists on a non-root UID as well.
USER 65532:65532
EXPOSE 8443
ENTRYPOINT ["gpuguard", "serve"]
