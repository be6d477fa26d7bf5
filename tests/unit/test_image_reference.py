"""Image references follow the container reference grammar (distribution/reference, OCI digests).

A reference the kubelet cannot pull must be one line naming the flag here, not an
``ImagePullBackOff`` on every node after the job was created.
"""

from __future__ import annotations

import pytest

from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.images import check_reference
from kfp_nvrx.components.launch.jobspec.spec import check_image

HEX64 = "0123456789abcdef" * 4


@pytest.mark.parametrize("ref", [
    "img:1", "localhost:5000/kfp-nvrx/kfp-nvrx-trainer:0.1.0",
    "123456789012.dkr.ecr.us-west-2.amazonaws.com/kfp-nvrx/kfp-nvrx-trainer:0.1.0",
    f"ghcr.io/owner/image@sha256:{HEX64}", f"repo:v1.2_rc-3@sha256:{HEX64}",
    f"registry:5000/a/b@sha512:{HEX64 * 2}", "[::1]:5000/img:1", "a__b/c-d/e.f:tag",
    "MyRegistry.io/repo:1",  # host names are case-insensitive; only repositories are lower-case
])
def test_valid_references_pass_unchanged(ref):
    assert check_reference("--image", ref) == ref == check_image(ref)


@pytest.mark.parametrize("ref, needle", [
    ("img:1\nX-Evil: 1", "whitespace or a control character"),
    (" img:1", "whitespace"), ("img:1 extra", "whitespace"), ("img:1\x00", "control"),
    ("img@sha256:abc", "64 lower-case hex digits, got 3 characters"),
    (f"img@sha256:{HEX64}0", "got 65 characters"),
    (f"img@sha256:{HEX64.upper()}", "other characters than 0-9 and a-f"),
    (f"img@sha512:{HEX64}", "128 lower-case hex digits"),
    (f"img@md5:{HEX64}", "digest algorithm 'md5'"),
    ("Img:1", "lower-case"), ("ghcr.io/Owner/img:1", "lower-case"), ("a/B/c", "lower-case"),
    ("img:", "not [host[:port]/]name"), ("img::1", "not [host"), ("img//x", "not [host"),
    ("img:-tag", "not [host"), ("img:" + "t" * 129, "not [host"), ("/img", "not [host"),
    ("a" * 256, "at most 255"),
])
def test_invalid_references_name_the_flag_in_one_line(ref, needle):
    with pytest.raises(UserError) as err:
        check_image(ref)
    assert err.value.field == "image" and needle in err.value.message
    assert "\n" not in err.value.one_line()
    if ref.strip():
        assert "required" not in err.value.message  # a bad image is invalid, not missing


def test_missing_image_is_required():
    with pytest.raises(UserError, match="required"):
        check_image("")
