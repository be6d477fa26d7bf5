"""Fast and local-run tests of the library (no HTTP double, no cluster)."""
