//go:build tools

// Package tools pins the Kueue controller manager command `make cluster-bins` builds.
package tools

import _ "sigs.k8s.io/kueue/cmd/kueue"
