//go:build tools

// Package tools pins the training-operator controller command `make cluster-bins` builds.
package tools

import _ "github.com/kubeflow/training-operator/cmd/training-operator.v1"
