# One kubeloop image holding every console script (kubeloop-pv-controller, kubeloop-csi-driver, ...)
# and `python -m localstack.compose` for the compose stack's init/setup/healthchecks.
#
# The Python packages come from build/wheels/, which `make wheels` (part of `make images`) fills on
# the host: the kubeloop wheel, whose generated gRPC stubs need the host's Go toolchain, and every
# dependency. With PIP_NO_INDEX=0 pip may fetch missing dependencies from the index instead.
ARG BASE_IMAGE=debian:bookworm-slim
ARG KUBECTL_IMAGE=registry.k8s.io/kubectl:v1.36.3

FROM ${KUBECTL_IMAGE} AS kubectl

FROM ${BASE_IMAGE} AS build
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3 python3-venv >/dev/null \
 && rm -rf /var/lib/apt/lists/*
# Dependencies first: this layer stays cached until pyproject.toml changes.
COPY build/wheels/deps /wheels/deps
ARG PIP_NO_INDEX=1
RUN python3 -m venv /opt/kubeloop \
 && if [ "$PIP_NO_INDEX" = 1 ]; then no_index=--no-index; else no_index=; fi \
 && /opt/kubeloop/bin/pip install -q --no-cache-dir --disable-pip-version-check $no_index \
      --find-links=/wheels/deps /wheels/deps/*.whl
COPY build/wheels/kubeloop-*.whl /wheels/
RUN /opt/kubeloop/bin/pip install -q --no-cache-dir --disable-pip-version-check --no-index --no-deps \
      /wheels/kubeloop-*.whl \
 && /opt/kubeloop/bin/pip uninstall -q -y pip setuptools

FROM ${BASE_IMAGE}
# The tools the CSI driver runs: losetup/blkid/findmnt (util-linux), mount, mkfs.ext4/resize2fs
# (e2fsprogs), mkfs.xfs/xfs_growfs (xfsprogs).
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      python3 util-linux mount e2fsprogs xfsprogs >/dev/null \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /usr/share/doc/* /usr/share/man/* \
 && useradd --uid 65532 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin nonroot
COPY --from=build /opt/kubeloop /opt/kubeloop
COPY --from=kubectl /bin/kubectl /usr/local/bin/kubectl
COPY deploy /usr/share/kubeloop/deploy
# external-snapshotter's CRDs, from its client module at the pinned version (build/crds, which
# tools/build-images.sh fills from the build cache): compose's setup service applies them.
COPY build/crds /usr/share/kubeloop/crds
ENV PATH=/opt/kubeloop/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
LABEL org.opencontainers.image.title=kubeloop \
      org.opencontainers.image.description="The Kubernetes storage control plane in Python asyncio"
# No USER: like upstream's sidecar images (distroless, no USER), the image runs as root unless the
# pod says otherwise, so kubeloop's sidecars reach a driver socket only root may open in manifests
# written for upstream's images. kubeloop's own manifests say who each container runs as: the
# controllers, and the sidecars that need no root, as the user `nonroot` made above (65532).
WORKDIR /opt/kubeloop
CMD ["kubeloop-stack", "--help"]
