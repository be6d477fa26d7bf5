"""Our env defaults of the trainer container, for the launcher's pod spec.

They live in the torch-free core (:mod:`kfp_nvrx.components.core.pod_env`), where the
``kfp-nvrx-ft`` runtime's own command reads them too (a TrainJob made by the Kubeflow SDK);
re-exported here for the launcher side.
"""

from __future__ import annotations

from kfp_nvrx.components.core.pod_env import default_env, gpu_env

__all__ = ["default_env", "gpu_env"]
