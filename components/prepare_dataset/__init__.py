"""prepare_dataset."""
