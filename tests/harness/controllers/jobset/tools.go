//go:build tools

// Package tools pins the jobset controller command `make cluster-bins` builds.
package tools

import _ "sigs.k8s.io/jobset"
