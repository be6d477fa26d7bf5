//go:build tools

// Package tools pins the Kubernetes and etcd commands `make cluster-bins` builds (go build of these
// import paths inside this module uses go.mod's versions and replaces).
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
)
