"""Kubernetes quantities are compared as amounts (the client's parse_quantity), never as text."""

from __future__ import annotations

from decimal import Decimal

import pytest

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.jobspec.spec import quantity, same_quantity


@pytest.mark.parametrize("a,b", [("1Gi", "1024Mi"), ("1", "1000m"), ("1k", "1000"),
                                 ("0.5Gi", "512Mi"), ("5120Mi", "5Gi")])
def test_one_amount_written_two_ways_is_the_same_quantity(a: str, b: str) -> None:
    assert quantity(a) == quantity(b) and same_quantity(a, b)


def test_different_amounts_and_non_quantities() -> None:
    assert quantity("1Gi") == Decimal(2**30) and not same_quantity("1Gi", "1G")
    assert same_quantity("x", "x") and not same_quantity("x", "1")
    with pytest.raises(ValueError):
        quantity("lots")



def test_request_and_limit_compare_as_amounts_and_zero_hugepages_mean_none():
    """The offline pod check compares 1Gi with 1024Mi as the server does; 0Mi is no hugepages."""
    from kfp_nvrx.components.launch.kube import validation

    pod = {"spec": {"containers": [{"name": "pytorch", "image": "x", "resources": {
        "requests": {"hugepages-2Mi": "1Gi", "memory": "1Gi"},
        "limits": {"hugepages-2Mi": "1024Mi"}}}]}}
    validation.resource_rules(pod)  # equal amounts: accepted
    pod["spec"]["containers"][0]["resources"]["limits"]["hugepages-2Mi"] = "2Gi"
    with pytest.raises(UserError, match="request and limit must be equal"):
        validation.resource_rules(pod)
