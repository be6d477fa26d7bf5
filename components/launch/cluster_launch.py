"""A resolved job launched on a cluster, the same way for every job API; ``auto`` picks the API.

The order is what keeps bad input one line naming its field, even where no cluster answers: the
job takes the connection's namespace when its spec named none (read without credentials); the
job API is the one asked for, or for ``auto`` the one the cluster serves (API discovery,
:func:`pick`: the only step that needs credentials first); the job is rendered once, validated
the way the cluster would, before credentials are loaded; then, with a client, Kueue's default
LocalQueue of the namespace is looked up (a job queued there is rendered again, as queued), and
:class:`.kube.job_run.JobRun` creates or re-attaches to the job and follows it to its end.

It chooses between the registered job APIs, so it sits above their registry (:mod:`.job_apis`)
and the folders it names; :mod:`.kube` holds the client pieces they share, below them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kfp_nvrx.components.launch import job_apis
from kfp_nvrx.components.launch.job_api import JobApi
from kfp_nvrx.components.launch.kube.cluster import Cluster
from kfp_nvrx.components.launch.kube.job_run import JobRun
from kfp_nvrx.components.launch.kube.kubeconfig import check_kubeconfig
from kfp_nvrx.components.launch.kube.kueue import with_default_queue
from kfp_nvrx.components.launch.options import AUTO
from kfp_nvrx.components.launch.result import LaunchResult
from kfp_nvrx.components.redaction import register_kube_defaults

if TYPE_CHECKING:
    from kfp_nvrx.components.launch.jobspec.resolve import ResolvedJob
    from kfp_nvrx.components.launch.options import KubernetesOptions


def launch_on_cluster(job: ResolvedJob, opts: KubernetesOptions,
                      log: Callable[[str], None]) -> LaunchResult:
    """Run ``job`` on the cluster of ``opts`` as its job API says, and follow it to its end.

    Returns:
        The result; ``extra["job_api"]`` names the job API it ran on.

    Raises:
        UserError: Bad input or a name clash with another run's job (nothing is created).
        ClusterError: The cluster refused or could not answer.
    """
    run = JobRun(opts.follow, log, job_apis.resources)
    if opts.cluster is None or opts.cluster.configuration is None:
        check_kubeconfig(None)  # a FIFO or /dev/zero: refused before anything opens it
    register_kube_defaults()  # what a default loader reads is redacted too
    cluster = opts.cluster or Cluster()
    if not job.namespace:
        job = job.in_namespace(cluster.namespace)
    api = _job_api(opts.job_api, cluster, run.say)
    rendered = api.render(job, opts)  # once for that API, before credentials are loaded
    client = cluster.client()
    if (queued := with_default_queue(client, job, run.say)) is not None:
        rendered = api.render(queued, opts)
    result = run.run(api.follow(rendered.resolved, client, run.say), rendered, client)
    result.extra["job_api"] = api.name
    return result


def served(client: Any) -> list[str]:
    """The registered job APIs the cluster serves (API discovery, one call each), in order."""
    from kubernetes.client.rest import ApiException

    from kfp_nvrx.components.launch.kube import calls

    out, host = [], calls.host_of(client)
    for name in job_apis.REGISTRY:
        res = job_apis.get(name).resource
        action = f"asking the API server for {res.group}/{res.version}"
        try:
            resp = calls.call(action, host, client.call_api, f"/apis/{res.group}/{res.version}",
                              "GET", response_type="object", auth_settings=["BearerToken"],
                              _return_http_data_only=True, ok=(404,))
        except ApiException:
            continue  # the group/version is not served
        resources = calls.expect_object(resp, action, host).get("resources") or []
        if any(isinstance(r, dict) and r.get("name") == res.plural for r in resources):
            out.append(name)
    return out


def pick(job_api: str, client: Any) -> str:
    """Return ``job_api``, or for ``auto`` the first registered API the cluster serves.

    Args:
        job_api: A registered name or ``auto``.
        client: An ``ApiClient`` (asked only for ``auto``; None: it serves none).

    Raises:
        UserError: ``job_api`` is not one of :func:`.job_apis.choices`.
        ClusterError: ``auto`` and the cluster serves none of them.
    """
    if job_api != AUTO:
        return job_apis.get(job_api).name
    from kfp_nvrx.components.launch.kube.calls import ClusterError

    found = served(client) if client is not None else []
    if found:
        return found[0]
    wanted = " nor ".join(f"{r.plural}.{r.group} ({r.served_by})"
                          for r in (job_apis.get(name).resource for name in job_apis.REGISTRY))
    raise ClusterError(f"--job-api auto: the cluster serves neither {wanted}")


def _job_api(name: str, cluster: Cluster, say: Callable[[str], None]) -> JobApi:
    """The job API ``name``; for ``auto`` the one the cluster serves (said in one line)."""
    if name != AUTO:
        return job_apis.get(name)
    picked = pick(name, cluster.client())
    say(f"--job-api auto: the cluster serves {picked}")
    return job_apis.get(picked)
