#!/usr/bin/env bash
# Makes sure the machine has what sluice's local infrastructure runs on:
# Java 17+ (the Kafka broker), Maven (fetches the Kafka jars), PostgreSQL's
# server, Python's venv module, Prometheus (the alert rules' tests), and iproute2
# and nftables (the networked fault run). Installs missing ones with apt-get when
# run as root on Debian/Ubuntu; otherwise says what to install.
# Then fetches the AsyncAPI 3.0.0 JSON Schema (npm's @asyncapi/specs, pinned) into
# the cache, for the test that validates `sluice schemas export --asyncapi`.
set -euo pipefail

missing=()
command -v java >/dev/null 2>&1 || missing+=(openjdk-17-jre-headless)
command -v mvn >/dev/null 2>&1 || missing+=(maven)
compgen -G "/usr/lib/postgresql/*/bin/postgres" >/dev/null || command -v postgres >/dev/null 2>&1 \
  || missing+=(postgresql)
python3 -c "import ensurepip, venv" 2>/dev/null || missing+=(python3-venv)
command -v npm >/dev/null 2>&1 || missing+=(npm)
# Prometheus and promtool: the alert rules' and dashboard's tests run a real one.
command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 \
  || missing+=(prometheus)
# The networked fault run (`sluice bench chaos --networked`, the suite's chaos seeds)
# needs root anyway: network namespaces and veths (iproute2), partitions and loss
# (nftables). Installed as root; without them that run says why and runs without.
if [ "$(id -u)" = "0" ]; then
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  command -v nft >/dev/null 2>&1 || missing+=(nftables)
fi

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing system packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}"
    # Debian's package starts its own cluster; sluice runs its own, so stop that one.
    if [ -x /usr/sbin/service ] && printf '%s\n' "${missing[@]}" | grep -qx postgresql; then
      service postgresql stop >/dev/null 2>&1 || true
    fi
    # Likewise Prometheus: the tests start their own, on free ports.
    if [ -x /usr/sbin/service ] && printf '%s\n' "${missing[@]}" | grep -qx prometheus; then
      service prometheus stop >/dev/null 2>&1 || true
    fi
  else
    echo "missing system packages: ${missing[*]} (install them, e.g. apt-get install ${missing[*]})" >&2
    exit 1
  fi
fi

# Kept in the cache (never in the repository); no network once this version is there.
ASYNCAPI_SPECS_VERSION=6.11.1
specs_dir="${SLUICE_ASYNCAPI_SPECS_DIR:-$HOME/.cache/sluice/asyncapi-specs}"
if ! grep -qs "\"version\": \"$ASYNCAPI_SPECS_VERSION\"" \
    "$specs_dir/node_modules/@asyncapi/specs/package.json"; then
  echo "fetching @asyncapi/specs@$ASYNCAPI_SPECS_VERSION into $specs_dir"
  mkdir -p "$specs_dir"
  npm install --prefix "$specs_dir" --no-audit --no-fund --silent \
    "@asyncapi/specs@$ASYNCAPI_SPECS_VERSION"
fi
