#!/usr/bin/env bash
# Make sure a `redis-server` binary is on PATH (tests and `scripts/run.sh` start their own
# process on a free loopback port; no system service is started or enabled here).
# Idempotent: does nothing when redis-server is already installed.
# Usage: scripts/install_redis.sh
set -euo pipefail
say() { printf '\033[1m[install_redis]\033[0m %s\n' "$*"; }
die() { printf '\033[1m[install_redis]\033[0m ERROR: %s\n' "$*" >&2; exit 1; }

if command -v redis-server >/dev/null 2>&1; then
  say "redis-server already installed: $(command -v redis-server) ($(redis-server --version | head -n1))"
  exit 0
fi

command -v apt-get >/dev/null 2>&1 \
  || die "redis-server is not on PATH and apt-get is unavailable; install Redis (>= 6) by hand."

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    die "redis-server is not on PATH; installing it needs root (run as root, or: sudo apt-get install redis-server)."
  fi
fi

# Some images have an init-system policy that would start the service on install; keep
# it from doing so (we never want a system Redis on 6379 competing with the test ones).
export DEBIAN_FRONTEND=noninteractive
policy=/usr/sbin/policy-rc.d
created_policy=0
if [ ! -e "$policy" ] && [ -z "$SUDO" ]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created_policy=1
fi
cleanup() { if [ "$created_policy" = 1 ]; then rm -f "$policy"; fi; }
trap cleanup EXIT

say "apt-get update"
$SUDO apt-get update -qq || die "apt-get update failed (no access to the package mirror?)"
say "apt-get install redis-server"
$SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null \
  || die "apt-get install redis-server failed"

# Stop a service the package may have started despite the policy (non-systemd images).
if command -v service >/dev/null 2>&1; then
  $SUDO service redis-server stop >/dev/null 2>&1 || true
fi

command -v redis-server >/dev/null 2>&1 || die "redis-server still not on PATH after install"
say "installed: $(command -v redis-server) ($(redis-server --version | head -n1))"
