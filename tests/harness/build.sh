#!/usr/bin/env bash
# Builds the control plane the cluster tests run, from Go modules, into a cache outside the
# checkout keyed by every pinned version (`make cluster-bins`); a second call reuses the cache.
# The versions are pinned by the Go modules in this folder: ./go.mod (Kubernetes, etcd) and
# controllers/*/go.mod (one per Kubeflow controller: they need newer k8s.io modules than the
# control plane, so they cannot share one build list with it).
# Writes <cache>/build-times.tsv (seconds, peak MiB and binary MiB of each build), <cache>/versions.txt,
# the upstream manifests the tests install (<cache>/manifests), and ./.bins (the bin folder).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
command -v go >/dev/null || { echo "cluster-bins: no Go toolchain on PATH (Go 1.26+ is needed)" >&2; exit 2; }
mods=("$here" "$here"/controllers/*)
# The Kubernetes binaries report the version they were built from (/version, `kubectl version`):
# component-base's version variables, set the way the Kubernetes release sets them, with the build
# date taken from the module's tag time (SOURCE_DATE_EPOCH style: the same build gives the same
# binary). The commit is not known from the module proxy, so it is left empty, not made up.
kube_version() { (cd "$here" && go list -m -f "$1" k8s.io/kubernetes); }
kv=$(kube_version '{{.Version}}'); kt=$(kube_version '{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}')
[[ $kv =~ ^v([0-9]+)\.([0-9]+)\. ]] || { echo "cluster-bins: cannot parse k8s.io/kubernetes $kv" >&2; exit 2; }
kube_ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  kube_ldflags+=" -X $pkg.gitVersion=$kv -X $pkg.gitMajor=${BASH_REMATCH[1]}"
  kube_ldflags+=" -X $pkg.gitMinor=${BASH_REMATCH[2]} -X $pkg.gitCommit= -X $pkg.gitTreeState=clean"
  kube_ldflags+=" -X $pkg.buildDate=$kt"
done
key=$( (for m in "${mods[@]}"; do cat "$m/go.mod" "$m/go.sum"; done; go env GOVERSION GOARCH
        echo "$kube_ldflags") | sha256sum | cut -c1-16)
root="${KFP_NVRX_CLUSTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kfp-nvrx/cluster-bins}"
out="$root/$key"
mkdir -p "$out/bin"
export CGO_ENABLED=0 GOFLAGS="-trimpath -buildvcs=false -mod=readonly"
ldflags="-s -w"

# One build at a time: a second `make cluster-bins` (a test run beside a shell) waits for the first.
exec 9>"$out/.lock"
flock 9

build() {  # module dir, binary name, package [, extra ldflags]: records seconds, peak RSS (MiB), size (MiB)
  local dir=$1 name=$2 pkg=$3 extra=${4:-}
  [[ -x "$out/bin/$name" ]] && return
  echo "cluster-bins: building $name ($pkg)" >&2
  local t0=$SECONDS
  (cd "$dir" && /usr/bin/time -f "%M" -o "$out/.rss" go build -ldflags "$ldflags$extra" -o "$out/bin/.$name.tmp" "$pkg")
  mv "$out/bin/.$name.tmp" "$out/bin/$name"
  printf '%s\t%s\t%s\t%s\n' "$name" "$((SECONDS - t0))" "$(( $(cat "$out/.rss") / 1024 ))" \
    "$(( $(stat -c %s "$out/bin/$name") >> 20 ))" >>"$out/build-times.tsv"
}
moddir() { (cd "$1" && go list -m -f '{{.Dir}}' "$2"); }

build "$here" etcd go.etcd.io/etcd/server/v3
for cmd in kube-apiserver kube-controller-manager kube-scheduler; do
  build "$here" "$cmd" "k8s.io/kubernetes/cmd/$cmd" "$kube_ldflags"
done
c="$here/controllers"
build "$c/trainer" trainer-controller-manager github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager
build "$c/jobset" jobset-controller sigs.k8s.io/jobset
build "$c/training-operator" training-operator github.com/kubeflow/training-operator/cmd/training-operator.v1
build "$c/kueue" kueue sigs.k8s.io/kueue/cmd/kueue

# The upstream manifests at the same versions (CRDs, webhook configurations, runtimes).
if [[ ! -f "$out/manifests/.done" ]]; then
  m="$out/manifests"; rm -rf "$m"; mkdir -p "$m"
  t=$(moddir "$c/trainer" github.com/kubeflow/trainer/v2)
  mkdir -p "$m/trainer"; cp -r "$t/manifests/base/crds" "$t/manifests/base/webhook" "$t/manifests/base/runtimes" "$m/trainer/"
  j=$(moddir "$c/jobset" sigs.k8s.io/jobset)
  mkdir -p "$m/jobset"; cp -r "$j/config/components/crd/bases" "$m/jobset/crds"; cp -r "$j/config/components/webhook" "$m/jobset/"
  o=$(moddir "$c/training-operator" github.com/kubeflow/training-operator)
  mkdir -p "$m/training-operator"; cp -r "$o/manifests/base/crds" "$o/manifests/base/webhook" "$m/training-operator/"
  q=$(moddir "$c/kueue" sigs.k8s.io/kueue)
  mkdir -p "$m/kueue"; cp -r "$q/config/components/crd/bases" "$m/kueue/crds"
  cp -r "$q/config/components/crd/patches" "$q/config/components/webhook" "$m/kueue/"
  chmod -R u+w "$m"; touch "$m/.done"
fi
{ (cd "$here" && go list -m -f '{{.Path}} {{.Version}}' k8s.io/kubernetes go.etcd.io/etcd/server/v3)
  (cd "$c/trainer" && go list -m -f '{{.Path}} {{.Version}}' github.com/kubeflow/trainer/v2)
  (cd "$c/jobset" && go list -m -f '{{.Path}} {{.Version}}' sigs.k8s.io/jobset)
  (cd "$c/training-operator" && go list -m -f '{{.Path}} {{.Version}}' github.com/kubeflow/training-operator)
  (cd "$c/kueue" && go list -m -f '{{.Path}} {{.Version}}' sigs.k8s.io/kueue)
} >"$out/versions.txt"
echo "$out/bin" >"$here/.bins"
echo "$out/bin"
