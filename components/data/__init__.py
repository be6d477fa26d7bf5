"""Token shards on the shared volume: sources, tokenizing, the checked shard index (torch-free)."""
