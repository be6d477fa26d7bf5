"""export_checkpoint."""
