#!/usr/bin/env bash
# Installs the Debian packages bulkhead builds with, if any are missing. Idempotent.
set -euo pipefail
packages=(build-essential cmake ninja-build pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  capnproto libcapnp-dev libboost-dev libspdlog-dev nlohmann-json3-dev libcli11-dev
  libgtest-dev libgmock-dev python3-grpcio python3-yaml libcpp-httplib-dev openssl systemd
  libsystemd-dev debootstrap systemd-container util-linux curl
  clang-14 libclang-rt-14-dev libomp-14-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
