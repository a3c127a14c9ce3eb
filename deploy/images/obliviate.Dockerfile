# The sidecar: Debian's python3 (3.11), a venv with the CPU torch wheel and the project's
# own wheel (staged in the build context by build.sh), numba kernels compiled at build
# time. One image for `serve`, `worker`, `consume` and the command line; it runs as uid
# 1034 (as deploy/k8s/ asks), owning /models and /keys (0700) so new volumes start so.
# See docs/operations.md (Images).
FROM obliviate-base:bookworm
RUN apt-get update && apt-get install -y python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd -g 1034 obliviate && useradd -u 1034 -g 1034 -d /var/lib/obliviate -m obliviate \
    && install -d -o 1034 -g 1034 /opt/obliviate /models && install -d -o 1034 -g 1034 -m 700 /keys
ENV PATH=/opt/obliviate/bin:$PATH PYTHONUNBUFFERED=1 BENTOML_DO_NOT_TRACK=true \
    BENTOML_HOME=/var/lib/obliviate/bentoml
USER 1034
# ca.crt: the build machine's trust store, for pip's TLS to the package registry
COPY ca.crt /tmp/ca.crt
COPY torch/ /tmp/torch/
RUN python3 -m venv /opt/obliviate \
    && pip install --no-cache-dir --cert /tmp/ca.crt /tmp/torch/*.whl
COPY dist/ /tmp/dist/
RUN pip install --no-cache-dir --cert /tmp/ca.crt /tmp/dist/*.whl
RUN python -m jobs.orchestration.warm_kernels
WORKDIR /var/lib/obliviate
ENTRYPOINT ["obliviate"]
