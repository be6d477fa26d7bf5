"""prepare_dataset: the KFP component that writes token shards onto the shared volume.

The library is ``kfp_nvrx.components.data``.
"""
