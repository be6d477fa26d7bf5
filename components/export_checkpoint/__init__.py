"""export_checkpoint: the KFP component that exports a run to safetensors with its eval loss.

The library is ``kfp_nvrx.components.training.export``.
"""
