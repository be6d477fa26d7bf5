"""The KFP pipelines (fsdp-train, scheduled-retrain), their compiled YAML, the KFP client and cron checks."""
