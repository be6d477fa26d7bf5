"""train_fsdp: the KFP component that launches FSDP training (library: ``kfp_nvrx.components.launch``)."""
