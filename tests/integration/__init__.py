"""End-to-end runs on real processes: the launcher, ft_launcher and the trainer, kfp.local
pipelines, the images' environments, the drills and the bad-input sweep (no cluster)."""
