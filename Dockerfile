# syntax=docker/dockerfile:1
#
# tollgate container image.
#
#   docker build -t tollgate .
#   docker run --rm -p 127.0.0.1:8080:8080 --add-host=host.docker.internal:host-gateway \
#     -v "$PWD/config:/etc/tollgate:ro" tollgate
#
# Inside the container 127.0.0.1 is the container itself, not your machine: an API running on
# the host is `upstream.url: http://host.docker.internal:8081` in the mounted gateway.yaml (the
# --add-host above makes that name resolve on Linux too), or use the API's own host name on a
# shared Docker network (as docker-compose.yml does).
#
# Pin the base images below to exact tags or digests of your registry for reproducible builds
# (pass --build-arg CHEF_IMAGE=... --build-arg RUNTIME_IMAGE=...). No registry, or no crates.io
# from the build? scripts/compose-images makes these base images from Debian's packages under
# the same names, and the crates for --build-arg CARGO_VENDOR_DIR (the `vendor` stage below);
# that is how tests/compose_stack.rs builds this file.
#
# The config is not baked in: mount a directory holding gateway.yaml (and the rules.yaml /
# keys.yaml it names) at /etc/tollgate. Mount the directory, not single files, so hot reload
# sees editors' atomic renames and Kubernetes' ..data symlink swaps.
#
# Ports: 8080 proxy (TOLLGATE_LISTEN overrides the config's `listen`), 9090 admin
# (/healthz /readyz /metrics ...). The HEALTHCHECK runs inside the container, so it works with
# admin_listen 127.0.0.1:9090 as well as 0.0.0.0:9090; scraping /metrics from another
# container needs admin_listen 0.0.0.0:9090.

ARG CHEF_IMAGE=lukemathwalker/cargo-chef:latest-rust-1-trixie
ARG RUNTIME_IMAGE=debian:trixie-slim

# ---- chef: Rust toolchain + cargo-chef ----------------------------------------------------
FROM ${CHEF_IMAGE} AS chef
WORKDIR /app
# Strip symbols from the release binary. Set here so `cook` and `build` use the same profile
# (a different profile would not reuse the cooked dependencies).
ENV CARGO_PROFILE_RELEASE_STRIP=symbols \
    CARGO_TERM_COLOR=never

# ---- vendor: the crates come from crates.io, or from the build context ---------------------
# A builder that cannot reach crates.io passes --build-arg CARGO_VENDOR_DIR=<a directory of the
# build context holding `cargo vendor` output plus a config.toml that points crates-io at
# /vendor> (scripts/compose-images makes target/compose-cache/vendor; CI builds this way).
# Unset, only Cargo.lock lands in /vendor, cargo's config is untouched and crates.io is used.
FROM chef AS vendor
ARG CARGO_VENDOR_DIR
COPY ${CARGO_VENDOR_DIR:-Cargo.lock} /vendor/
RUN if [ -f /vendor/config.toml ]; then cp /vendor/config.toml "$CARGO_HOME/config.toml"; fi

# ---- planner: the dependency recipe (changes only when Cargo.toml / Cargo.lock change) -----
FROM vendor AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

# ---- builder: dependencies in their own cached layer, then the crate ----------------------
FROM vendor AS builder
COPY --from=planner /app/recipe.json recipe.json
# Cargo.toml's [patch] points h2 at vendor/h2 in the tree; not a workspace member, so the
# recipe does not carry it, and cook needs it.
COPY vendor/h2 vendor/h2
# (cook always builds from the recipe's Cargo.lock; it has no --locked flag)
RUN cargo chef cook --release --recipe-path recipe.json --bin tollgate
COPY . .
RUN cargo build --release --locked --bin tollgate \
 && install -D -m 0755 target/release/tollgate /out/tollgate

# ---- runtime ------------------------------------------------------------------------------
FROM ${RUNTIME_IMAGE} AS runtime
# curl: for the HEALTHCHECK only. Unpinned on purpose: the slim base moves with security
# updates and pinning Debian package versions breaks the build on every point release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends curl ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 tollgate \
 && useradd --system --uid 10001 --gid tollgate --home-dir /nonexistent --no-create-home \
      --shell /usr/sbin/nologin tollgate \
 && install -d -m 0755 -o root -g root /etc/tollgate

COPY --from=builder /out/tollgate /usr/local/bin/tollgate

# Container defaults: listen on all interfaces inside the container (the config's `listen`
# is usually loopback-only for bare-metal use); logs are JSON when stdout is not a TTY.
ENV TOLLGATE_CONFIG=/etc/tollgate/gateway.yaml \
    TOLLGATE_LISTEN=0.0.0.0:8080 \
    RUST_LOG=info

# numeric ids, so Kubernetes' runAsNonRoot can verify them without reading /etc/passwd
USER 10001:10001
WORKDIR /etc/tollgate
EXPOSE 8080 9090
STOPSIGNAL SIGTERM

HEALTHCHECK --interval=10s --timeout=2s --start-period=10s --retries=3 \
  CMD ["curl", "-fsS", "-o", "/dev/null", "--max-time", "2", "http://127.0.0.1:9090/healthz"]

ENTRYPOINT ["tollgate"]
CMD ["run", "--config", "/etc/tollgate/gateway.yaml"]
