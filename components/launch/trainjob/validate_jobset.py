"""What a TrainingRuntime must pass besides its CRD schema, checked offline.

A runtime meets four checkers, and only the first two when it is applied:

1. The Trainer v2.3.0 TrainingRuntime webhook (a replicated job labelled as an ancestor step has
   one replica and the container that step needs) and the runtime CRD's CEL rules (one ML policy,
   no ``envInjection`` target on the ``node`` container, ``startupPolicy: InOrder`` not with
   ``dependsOn``).
2. Nothing else: the TrainJob webhook resolves the runtime but does not check its JobSet template.
3. The JobSet v0.12.0 webhook, when the Trainer controller creates the JobSet for a TrainJob:
   failure-policy rule names (``^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$``, 1..128 characters,
   unique), known ``onJobFailureReasons``, existing target jobs, alpha-gated actions and restart
   strategies, and the generated Job and Pod names (DNS-1035 labels, the pod name with the Job
   controller's 5-character suffix).
4. The API server's Job validation, when the JobSet controller creates each Job: the
   ``podFailurePolicy`` rules.

A failure in 3 or 4 is only a Warning event on the TrainJob or the JobSet after the job was
accepted, so :func:`validate_runtime` and :func:`validate_jobset_names` check them before anything
is created. Every failure is a :class:`UserError` naming the runtime field.
"""

from __future__ import annotations

import re
from typing import Any

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.naming import DNS1035, MAX_LABEL
from kfp_nvrx.components.launch.trainjob import runtime as rt

#: The TrainingRuntime webhook: ancestor label value -> the container that step must have.
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
ANCESTOR_CONTAINERS = {"trainer": rt.CONTAINER_NAME, "model-initializer": "model-initializer",
                       "dataset-initializer": "dataset-initializer"}
ML_POLICIES = ("torch", "mpi", "jax", "xgboost", "flux")
#: JobSet v0.12.0 webhook (pkg/webhooks/jobset_webhook.go).
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
RULE_NAME_MAX = 128
JOB_FAILURE_REASONS = ("BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes",
                       "MaxFailedIndexesExceeded", "PodFailurePolicy")
#: Behind JobSet alpha gates that are off by default (a default install refuses them).
GATED_ACTIONS = ("RestartJob", "RestartJobAndIgnoreMaxRestarts")
GATED_STRATEGIES = ("InPlaceRestart",)
#: The Job controller's random suffix of an indexed Job's pod names ("-" + 5 characters).
POD_SUFFIX = "-abcde"
#: Kubernetes 1.35 Job validation (pkg/apis/batch/validation).
MAX_PFP_RULES = 20
MAX_EXIT_CODES = 255


def _spec_path(i: int) -> str:
    return f"spec.template.spec.replicatedJobs[{i}]"


def validate_runtime_webhook(runtime: dict[str, Any]) -> None:
    """The TrainingRuntime webhook's and the runtime CRD's CEL rules (checked at apply time)."""
    spec = runtime.get("spec") or {}
    ml = spec.get("mlPolicy") or {}
    if sum(1 for p in ML_POLICIES if p in ml) > 1:
        raise UserError("spec.mlPolicy", "only one of the policies can be configured")
    targets = ((ml.get("torch") or {}).get("envInjection") or {}).get("targets") or []
    for i, target in enumerate(targets):
        if rt.CONTAINER_NAME in (target.get("containerNames") or []):
            raise UserError(f"spec.mlPolicy.torch.envInjection.targets[{i}].containerNames",
                            "must not include the main node container (PET_* envs are always "
                            "injected into it)")
    jobset = (spec.get("template") or {}).get("spec") or {}
    jobs = jobset.get("replicatedJobs") or []
    if (jobset.get("startupPolicy") or {}).get("startupPolicyOrder") == "InOrder" and \
            any("dependsOn" in j for j in jobs):
        raise UserError("spec.template.spec", "startupPolicy InOrder and dependsOn are mutually "
                        "exclusive")
    for i, job in enumerate(jobs):
        ancestor = ((job.get("template") or {}).get("metadata") or {}).get("labels", {}).get(
            ANCESTOR_LABEL)
        if ancestor not in ANCESTOR_CONTAINERS:
            continue
        if job.get("replicas", 1) != 1:  # the CRD defaults replicas to 1
            raise UserError(f"{_spec_path(i)}.replicas", "always must be 1")
        containers = _pod(job).get("containers") or []
        if not any(c.get("name") == ANCESTOR_CONTAINERS[ancestor] for c in containers):
            raise UserError(f"{_spec_path(i)}.template.spec.template.spec.containers",
                            f"must contain the required container for the ancestor: {ancestor}")


def _pod(job: dict[str, Any]) -> dict[str, Any]:
    return ((((job.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec")
            or {})


def validate_failure_policy(jobset: dict[str, Any], where: str = "spec.template.spec") -> None:
    """The JobSet webhook's rules on ``failurePolicy``, ``successPolicy`` and ``dependsOn``."""
    jobs = jobset.get("replicatedJobs") or []
    names = {j.get("name") for j in jobs}
    if jobs and jobs[0].get("dependsOn"):
        raise UserError(f"{where}.replicatedJobs[0].dependsOn", "can't be set for the first "
                        "ReplicatedJob")
    for i, job in enumerate(jobs):
        group = job.get("groupName", "default")
        if len(group) > MAX_LABEL or not DNS1035.match(group):
            raise UserError(f"{where}.replicatedJobs[{i}].groupName", "must be a DNS-1035 label")
    for name in (jobset.get("successPolicy") or {}).get("targetReplicatedJobs") or []:
        if name not in names:
            raise UserError(f"{where}.successPolicy.targetReplicatedJobs",
                            f"{name!r} does not appear in replicatedJobs")
    policy = jobset.get("failurePolicy")
    if not policy:
        return
    if policy.get("restartStrategy") in GATED_STRATEGIES:
        raise UserError(f"{where}.failurePolicy.restartStrategy", f"{policy['restartStrategy']} "
                        "needs a JobSet feature gate that is off by default")
    seen: set[str] = set()
    for i, rule in enumerate(policy.get("rules") or []):
        seen.add(_check_failure_rule(f"{where}.failurePolicy.rules[{i}]", i, rule, names, seen))


def _check_failure_rule(path: str, i: int, rule: dict[str, Any], names: set[Any],
                        seen: set[str]) -> str:
    """One failure policy rule (``seen``: the names of the rules before it); its name."""
    if rule.get("action") in GATED_ACTIONS:
        raise UserError(f"{path}.action", f"{rule['action']} needs the JobSet RestartJob "
                        "feature gate, off by default")
    # The webhook names an unnamed rule failurePolicyRule<i> before it validates.
    name = rule.get("name") or f"failurePolicyRule{i}"
    if len(name) > RULE_NAME_MAX or not RULE_NAME.match(name):
        raise UserError(f"{path}.name", f"{name!r}: a JobSet failure policy rule name must "
                        "start with a letter, then letters, digits or '_,:', end with a "
                        f"letter, digit or '_', at most {RULE_NAME_MAX} characters")
    if name in seen:
        raise UserError(f"{path}.name", f"{name!r}: rule names must be unique")
    for target in rule.get("targetReplicatedJobs") or []:
        if target not in names:
            raise UserError(f"{path}.targetReplicatedJobs",
                            f"{target!r} does not appear in replicatedJobs")
    for reason in rule.get("onJobFailureReasons") or []:
        if reason not in JOB_FAILURE_REASONS:
            raise UserError(f"{path}.onJobFailureReasons", f"{reason!r} is not a job "
                            f"failure reason ({', '.join(JOB_FAILURE_REASONS)})")
    return str(name)


def validate_pod_failure_policy(job: dict[str, Any], where: str) -> None:
    """The API server's Job validation of ``podFailurePolicy`` (when the Job is created)."""
    jspec = (job.get("template") or {}).get("spec") or {}
    pfp = jspec.get("podFailurePolicy")
    if not pfp:
        return
    path = f"{where}.template.spec.podFailurePolicy"
    pod = _pod(job)
    if pod.get("restartPolicy") != "Never":
        raise UserError(f"{where}.template.spec.template.spec.restartPolicy",
                        "only 'Never' is supported when podFailurePolicy is specified")
    rules = pfp.get("rules") or []
    if len(rules) > MAX_PFP_RULES:
        raise UserError(f"{path}.rules", f"at most {MAX_PFP_RULES} rules")
    containers = {c.get("name") for c in
                  [*(pod.get("containers") or []), *(pod.get("initContainers") or [])]}
    for i, rule in enumerate(rules):
        rpath = f"{path}.rules[{i}]"
        codes, conds = rule.get("onExitCodes"), rule.get("onPodConditions")
        if bool(codes) == bool(conds):
            raise UserError(rpath, "exactly one of onExitCodes and onPodConditions is required")
        if rule.get("action") == "FailIndex" and jspec.get("backoffLimitPerIndex") is None:
            raise UserError(f"{rpath}.action", "FailIndex requires backoffLimitPerIndex")
        if codes:
            _check_exit_codes(f"{rpath}.onExitCodes", codes, containers)


def _check_exit_codes(path: str, codes: dict[str, Any], containers: set[Any]) -> None:
    """A pod failure policy rule's ``onExitCodes``."""
    if codes.get("containerName") is not None and codes["containerName"] not in containers:
        raise UserError(f"{path}.containerName", "must be one of the container "
                        "or initContainer names in the pod template")
    values = codes.get("values") or []
    if not values or len(values) > MAX_EXIT_CODES:
        raise UserError(f"{path}.values", f"1..{MAX_EXIT_CODES} values")
    if codes.get("operator") == "In" and 0 in values:
        raise UserError(f"{path}.values", "must not be 0 for the In operator")
    if len(set(values)) != len(values) or values != sorted(values):
        raise UserError(f"{path}.values", "must be ordered and unique")


def validate_runtime(runtime: dict[str, Any]) -> None:
    """Every rule a runtime meets after its schema: at apply time and when a job is created."""
    validate_runtime_webhook(runtime)
    jobset = ((runtime.get("spec") or {}).get("template") or {}).get("spec") or {}
    validate_failure_policy(jobset)
    for i, job in enumerate(jobset.get("replicatedJobs") or []):
        validate_pod_failure_policy(job, _spec_path(i))


def validate_jobset_names(name: str, nodes: int, field: str = "metadata.name") -> None:
    """The JobSet webhook's name rules for a TrainJob of ``nodes`` nodes named ``name``.

    The JobSet is named after the TrainJob; its ``node`` Job is ``<name>-node-0`` and each pod
    ``<name>-node-0-<index>-<5 random characters>``, all DNS-1035 labels of at most 63.
    """
    for generated in (f"{name}-{rt.REPLICATED_JOB}-0",
                      f"{name}-{rt.REPLICATED_JOB}-0-{nodes - 1}{POD_SUFFIX}"):
        if len(generated) > MAX_LABEL or not DNS1035.match(generated):
            raise UserError(field, f"the JobSet would name a pod or Job {generated!r}, over "
                            f"{MAX_LABEL} characters or not a DNS-1035 label")
