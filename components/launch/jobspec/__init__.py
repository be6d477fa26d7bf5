"""jobspec."""
