"""kfp_nvrx.components: KFP components and the library they call."""

__version__ = "0.1.0"
