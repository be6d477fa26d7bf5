"""train_fsdp."""
