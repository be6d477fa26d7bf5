"""A connection to one Kubernetes API server: its bounded client and its namespace.

:class:`Cluster` is what the launcher needs of a cluster, loaded no sooner than needed: the
namespace a job goes to when its spec names none (the kubeconfig context's, or the pod's own in a
cluster) is read without credentials, and the credentials are loaded when the first call is made,
so a job the renderer refuses is reported before they are looked at; :func:`load_cluster` loads
them at once from a kubeconfig and context the user named (``launch --kubeconfig --context``).
Credentials and namespaces are read only here. Every client made here is bounded (:mod:`.http`)
and its credentials are redacted from every line printed later.
"""

from __future__ import annotations

import os
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


def sa_namespace() -> str:
    """This pod's namespace, from its service account ('' when empty).

    Raises:
        OSError: Not in a pod (no service account mounted).
    """
    with open(SA_NAMESPACE) as fh:
        return fh.read(256).strip()


def context_namespace(kubeconfig: str | None = None, context: str | None = None) -> str:
    """The namespace of a kubeconfig's context (None: its current one); ``default`` when unset.

    Raises:
        Exception: The kubeconfig cannot be read, or names no such context (the loader's own).
    """
    from kubernetes import config

    contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
    if context:
        active = next(c for c in contexts if c["name"] == context)
    return ((active or {}).get("context") or {}).get("namespace", "default")


def current_namespace() -> str:
    """The namespace a job goes to when none is given, the way kubectl picks it.

    Inside a pod: the service account's namespace. Elsewhere: the kubeconfig's current context's
    namespace (``kubectl config set-context --current --namespace=...``), else ``default``.
    """
    try:
        if ns := sa_namespace():
            return ns
    except OSError:
        pass
    try:
        check_kubeconfig(None)  # a FIFO there: "default", not a wait for a writer
        return context_namespace() or "default"
    except Exception:  # noqa: BLE001 - no kubeconfig: the API default
        return "default"


def load_cluster(kubeconfig: str = "", context: str = "", field: str = "kubeconfig") -> Cluster:
    """The cluster of the in-cluster service account or of a kubeconfig and context, loaded now.

    Its namespace (a job's that names none) is the service account's, or the context's. In a pod
    without ``kubeconfig`` or ``context``, the in-cluster credentials.

    Args:
        kubeconfig: The kubeconfig file ('' = the default one).
        context: Its context ('' = the current one).
        field: What names ``kubeconfig`` in a refusal (a CLI flag).

    Raises:
        UserError: ``kubeconfig`` is no regular file (named by ``field``).
        ClusterError: No credentials could be loaded (one line, no token quoted).
    """
    from kubernetes import client, config

    from kfp_nvrx.components.redaction import register_kube_configuration, register_kubeconfig

    cfg = client.Configuration()
    # Whatever authenticates us is cut out of every line printed from here on (the CLI's
    # redacting stdout/stderr), the file's values before the loader can quote them in an error.
    register_kube_configuration(cfg)
    in_cluster = "KUBERNETES_SERVICE_HOST" in os.environ and not (kubeconfig or context)
    if not in_cluster:
        # Before anything opens it: a FIFO hung the loader, a tokenFile of /dev/zero filled memory.
        check_kubeconfig(kubeconfig or None, field)
        register_kubeconfig(kubeconfig or None)
    try:
        if in_cluster:
            config.load_incluster_config(client_configuration=cfg)
            return Cluster(cfg, sa_namespace())
        config.load_kube_config(config_file=kubeconfig or None, context=context or None,
                                client_configuration=cfg)
        return Cluster(cfg, context_namespace(kubeconfig or None, context or None))
    except Exception as err:  # noqa: BLE001 - no/bad kubeconfig: one line
        raise ClusterError(f"cannot load Kubernetes credentials: {' '.join(str(err).split())}") \
            from None


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
