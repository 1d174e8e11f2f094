# syntax=docker/dockerfile:1
# continuum-router image: a glibc release binary on distroless (no shell, no package manager),
# running as the distroless non-root user 65532. Build and lint: see docs/deployment.md.
#
#   docker build -t continuum-router:$(cargo pkgid | cut -d'#' -f2) .
#   docker run --rm continuum-router:TAG --version

ARG RUST_VERSION=1.95.0

FROM docker.io/library/rust:${RUST_VERSION}-slim-bookworm AS build
WORKDIR /src
# The workspace as a whole (see .dockerignore); protoc comes from the protoc-bin-vendored crate
# through tools/protoc, so the build needs no system packages beyond the image's toolchain.
COPY . .
RUN cargo build --release --locked --bin continuum-router --bin continuum-event-broker \
        --bin continuum-kv-listener \
    && install -D -m 0755 target/release/continuum-router /out/continuum-router \
    && install -D -m 0755 target/release/continuum-event-broker /out/continuum-event-broker \
    && install -D -m 0755 target/release/continuum-kv-listener /out/continuum-kv-listener

FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=build /out/continuum-router /usr/local/bin/continuum-router
# The in-cluster event-bus agent (deploy/kubernetes/event-broker runs it with `command:`).
COPY --from=build /out/continuum-event-broker /usr/local/bin/continuum-event-broker
# The event bus's push agent (role kv_listener), run next to the backends with `command:`.
COPY --from=build /out/continuum-kv-listener /usr/local/bin/continuum-kv-listener
USER 65532:65532
# Front door, /health, /ready, /metrics and /admin/*; the event-bus listener when enabled.
EXPOSE 8080 7443
ENTRYPOINT ["/usr/local/bin/continuum-router"]
CMD ["--config", "/etc/continuum-router/router.yaml"]
