"""evaluate_promote: compare a candidate model with the promoted one and promote it if better."""
