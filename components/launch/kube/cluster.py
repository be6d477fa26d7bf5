"""A connection to one Kubernetes API server: its bounded client and its namespace.

:class:`Cluster` is what the launcher needs of a cluster, loaded no sooner than needed: the
namespace a job goes to when its spec names none (the kubeconfig context's, or the pod's own in a
cluster) is read without credentials, and the credentials are loaded when the first call is made,
so a job the renderer refuses is reported before they are looked at. Every client made here is
bounded (:mod:`.http`) and its credentials are redacted from every line printed later.
"""

from __future__ import annotations

from typing import Any

from kfp_nvrx.components.launch.kube import http
from kfp_nvrx.components.launch.kube.calls import ClusterError, configure
from kfp_nvrx.components.launch.kube.kubeconfig import check_kubeconfig


class Cluster:
    """One API server.

    Args:
        configuration: A ``kubernetes.client.Configuration`` (None: in-cluster credentials, else
            the kubeconfig's, loaded by :meth:`client`).
        namespace: The namespace of a job that names none ('' = :func:`current_namespace`).
    """

    def __init__(self, configuration: Any = None, namespace: str = "") -> None:
        self.configuration = configuration
        self._namespace = namespace
        self._client: Any = None

    @property
    def namespace(self) -> str:
        """The namespace of a job that names none (read once, no credentials needed)."""
        if not self._namespace:
            self._namespace = current_namespace()
        return self._namespace

    def client(self) -> Any:
        """The bounded ``ApiClient`` (credentials loaded on the first call).

        Raises:
            ClusterError: No credentials could be loaded (one line, no token quoted).
        """
        if self._client is None:
            self._client = api_client(self.configuration)
            configure(self._client.configuration)
        return self._client


#: Where a pod finds its own namespace (the KFP step runs in the profile's namespace).
SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def current_namespace() -> str:
    """The namespace a job goes to when none is given, the way kubectl picks it.

    Inside a pod: the service account's namespace. Elsewhere: the kubeconfig's current context's
    namespace (``kubectl config set-context --current --namespace=...``), else ``default``.
    """
    try:
        with open(SA_NAMESPACE) as fh:
            if ns := fh.read(256).strip():
                return ns
    except OSError:
        pass
    try:
        from kubernetes import config

        check_kubeconfig(None)  # a FIFO there: "default", not a wait for a writer
        _, active = config.list_kube_config_contexts()
        return (active or {}).get("context", {}).get("namespace") or "default"
    except Exception:  # noqa: BLE001 - no kubeconfig: the API default
        return "default"


def api_client(configuration: Any = None) -> Any:
    """A Kubernetes ApiClient: ``configuration``, else in-cluster or kubeconfig credentials.

    Raises:
        ClusterError: No credentials could be loaded (one line, no token quoted).
    """
    from kubernetes import client, config

    from kfp_nvrx.components.redaction import register_kube_configuration, register_kubeconfig

    if configuration is None:
        configuration = client.Configuration()
        check_kubeconfig(None)  # no FIFO or /dev/zero for the loader (or the redaction) to open
        register_kubeconfig(None)  # before loading: a loader error must not quote a token
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            try:
                config.load_kube_config(client_configuration=configuration)
            except Exception as err:  # noqa: BLE001 - no kubeconfig: one line
                raise ClusterError(f"no Kubernetes credentials: {' '.join(str(err).split())}") \
                    from None
    register_kube_configuration(configuration)  # every later line we print is redacted
    return http.bound(client.ApiClient(configuration))
