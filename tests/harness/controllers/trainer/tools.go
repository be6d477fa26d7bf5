//go:build tools

// Package tools pins the trainer controller command `make cluster-bins` builds.
package tools

import _ "github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager"
