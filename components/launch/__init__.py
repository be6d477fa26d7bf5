"""The launcher side: a training job resolved once, then run on this machine or on a cluster.

* :mod:`.jobspec`: ``JobSpec`` (what the user said) -> :func:`.jobspec.resolve.resolve` ->
  ``ResolvedJob`` (what the job is; nothing else makes one), and the worker pod every job API
  shares (:mod:`.jobspec.pod`);
* :mod:`.backends`: ``launch(job, options)``, with :mod:`.options`;
* :mod:`.local`: the local backend (``LocalRun``: N ft_launcher agents on this machine);
* :mod:`.job_apis`: what a Kubernetes job API is (``JobApi``) and the registry of them, one
  folder each: :mod:`.pytorchjob`, :mod:`.trainjob` (render, validate, follow);
* :mod:`.kube`: the Kubernetes client pieces every job API shares (bounded calls, the cluster
  connection, the one custom-object client, create/follow/delete, pod logs, Kueue);
* :mod:`.result`, :mod:`.ui_outputs`: what a launch reports.

Torch-free: it runs in the components image and the CLI (``tests/unit/test_import_graph.py``).
"""
