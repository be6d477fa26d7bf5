"""The one place image references come from: the tag is always the package version.

Components (``base_image=``), the job specs (the trainer container) and the build commands in
``images/README.md`` all call these functions, so a pipeline compiled from version X can only name
images tagged X: definitions and images cannot drift apart.

The registry defaults to :data:`DEFAULT_REGISTRY`, a local registry that no one else can publish to
(a default pointing at a public registry would pull whatever someone pushed there). Set
``KFP_NVRX_REGISTRY`` to the registry you pushed to, e.g.
``123456789012.dkr.ecr.us-west-2.amazonaws.com/kfp-nvrx``, *before* importing or compiling the
pipelines: component decorators read it when their module is imported.

Build scripts ask for the same references from the command line::

    python -m kfp_nvrx.components.images trainer      # -> <registry>/kfp-nvrx-trainer:<version>
    python -m kfp_nvrx.components.images components --registry 1234.dkr.ecr.../kfp-nvrx
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from kfp_nvrx.components import __version__
from kfp_nvrx.components.errors import Surface, UserError

#: Environment variable that overrides the registry.
REGISTRY_ENV = "KFP_NVRX_REGISTRY"
#: Used when ``KFP_NVRX_REGISTRY`` is unset: a local registry (``docker run -p 5000:5000 registry``)
#: that nobody else can publish to.
DEFAULT_REGISTRY = "localhost:5000/kfp-nvrx"
#: Repository name of the KFP component image (``images/components/Dockerfile``).
COMPONENTS_IMAGE = "kfp-nvrx-components"
#: Repository name of the training image (``images/trainer/Dockerfile``).
TRAINER_IMAGE = "kfp-nvrx-trainer"
#: Image kind -> repository name (also the Dockerfile folder under ``images/``).
IMAGES = {"components": COMPONENTS_IMAGE, "trainer": TRAINER_IMAGE}

# Docker reference grammar (distribution/reference): an optional host[:port] followed by
# lower-case path components separated by '/'.
_LABEL = r"[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_HOST = rf"{_LABEL}(?:\.{_LABEL})*"
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REGISTRY_RE = re.compile(rf"^(?:{_HOST}(?::[0-9]+)?)(?:/{_PATH})*$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
# A whole reference: [host[:port]/]path[:tag][@algorithm:hex], hosts may be [IPv6].
_DOMAIN = rf"(?:{_HOST}|\[[0-9a-fA-F:.]+\])(?::[0-9]+)?"
_REFERENCE_RE = re.compile(rf"^(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_PATH}(?:/{_PATH})*)"
                           r"(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}))?"
                           r"(?:@(?P<algorithm>[A-Za-z0-9+._-]+):(?P<hex>[^/@:]*))?$")
#: Digest algorithms a registry serves (OCI image spec) -> hex digits of their digest.
DIGEST_HEX = {"sha256": 64, "sha512": 128}
#: Longest repository name (host and path) distribution/reference accepts.
MAX_NAME = 255


def check_reference(field: str, value: str) -> str:
    """Check an image reference against the container reference grammar (distribution/reference).

    ``[host[:port]/]path[:tag][@sha256:<64 hex>]``: path components lower-case, a tag of at most
    128 word characters, a digest of the length its algorithm gives. A reference the kubelet
    cannot pull must fail here, in one line, not as ``ImagePullBackOff`` on every node.

    Args:
        field: The flag or parameter the reference came from (named in the error).
        value: The reference as given.

    Returns:
        ``value`` unchanged.

    Raises:
        UserError: Naming ``field``, what is wrong and an example.

    """
    example = "e.g. 123456789012.dkr.ecr.us-west-2.amazonaws.com/kfp-nvrx/kfp-nvrx-trainer:0.1.0"
    if not value:
        raise UserError(field, f"the image is required ({example})")
    if any(ch.isspace() or not ch.isprintable() for ch in value):
        raise UserError(field, f"invalid image {value!r}: it holds whitespace or a control "
                        f"character; give one reference, {example}")
    match = _REFERENCE_RE.match(value)
    if match is None:
        name = value.split("@", 1)[0]
        last = name.rsplit("/", 1)[-1]
        repo = name[:len(name) - len(last)] + last.split(":", 1)[0]
        why = ("the repository must be lower-case" if repo != repo.lower() else
               "not [host[:port]/]name[:tag][@sha256:digest] (name components of a-z, 0-9 and "
               "single '.', '_' or '-' between them; a tag of at most 128 letters, digits, '_', "
               "'.', '-')")
        raise UserError(field, f"invalid image {value!r}: {why}; {example}")
    name = value.split("@", 1)[0].rsplit(":", 1)[0] if match["tag"] else value.split("@", 1)[0]
    if len(name) > MAX_NAME:
        raise UserError(field, f"invalid image: the repository name is {len(name)} characters "
                        f"long, at most {MAX_NAME} are allowed")
    if match["algorithm"] is not None:
        algorithm, digits = match["algorithm"], match["hex"]
        want = DIGEST_HEX.get(algorithm)
        if want is None:
            raise UserError(field, f"invalid image {value!r}: digest algorithm {algorithm!r}; "
                            f"use {' or '.join(DIGEST_HEX)}")
        if len(digits) != want or not re.fullmatch(r"[0-9a-f]+", digits):
            got = (f"{len(digits)} characters" if len(digits) != want else
                   "other characters than 0-9 and a-f")
            raise UserError(field, f"invalid image {value!r}: a {algorithm} digest is {want} "
                            f"lower-case hex digits, got {got}")
    return value


def registry(value: str | None = None) -> str:
    """Return the registry prefix: ``value``, else ``$KFP_NVRX_REGISTRY``, else the default.

    Args:
        value: An explicit registry (host[:port][/path]); ``None`` reads the environment.

    Raises:
        UserError: The registry is not a valid image reference prefix.

    """
    field = "registry" if value is not None else REGISTRY_ENV
    raw = value if value is not None else os.environ.get(REGISTRY_ENV, "")
    reg = raw.strip() or DEFAULT_REGISTRY
    if "://" in reg:
        raise UserError(field, f"{raw!r} has a URL scheme; give host[:port]/path only, "
                               "e.g. 123456789012.dkr.ecr.us-west-2.amazonaws.com/kfp-nvrx")
    if not _REGISTRY_RE.match(reg):
        raise UserError(field, f"{raw!r} is not a registry prefix (host[:port]/path, lower-case "
                               "path, no tag, no trailing '/'), "
                               "e.g. 123456789012.dkr.ecr.us-west-2.amazonaws.com/kfp-nvrx")
    return reg


def image_tag(version: str = __version__) -> str:
    """Return the image tag for a package version (``+`` of a local version becomes ``-``).

    Raises:
        UserError: The version cannot be written as an image tag.

    """
    tag = version.replace("+", "-")
    if not _TAG_RE.match(tag):
        raise UserError("version", f"{version!r} cannot be an image tag")
    return tag


def image_ref(kind: str, registry_value: str | None = None) -> str:
    """Return the full reference ``<registry>/<repository>:<version>`` of one image.

    Args:
        kind: ``components`` or ``trainer``.
        registry_value: Explicit registry; ``None`` uses ``$KFP_NVRX_REGISTRY`` or the default.

    Raises:
        UserError: Unknown kind or a bad registry.

    """
    if kind not in IMAGES:
        raise UserError("image", f"unknown image {kind!r}; choose one of {', '.join(IMAGES)}")
    return f"{registry(registry_value)}/{IMAGES[kind]}:{image_tag()}"


def components_image(registry_value: str | None = None) -> str:
    """Return the component image: the ``base_image`` of every KFP component."""
    return image_ref("components", registry_value)


def trainer_image(registry_value: str | None = None) -> str:
    """Return the training image: the trainer container of the worker pods."""
    return image_ref("trainer", registry_value)


def main(argv: Sequence[str] | None = None) -> int:
    """Print one image reference (used by the build commands in ``images/README.md``)."""
    parser = argparse.ArgumentParser(
        prog="python -m kfp_nvrx.components.images",
        description="Print the image reference the components and job spec use.",
    )
    parser.add_argument("kind", choices=sorted(IMAGES), help="which image")
    parser.add_argument("--registry", default=None,
                        help=f"registry prefix (default: ${REGISTRY_ENV} or {DEFAULT_REGISTRY})")
    args = parser.parse_args(argv)
    try:
        print(image_ref(args.kind, args.registry))
    except UserError as err:
        sys.stderr.write(f"error: {Surface({'registry': '--registry'}).reword(err).one_line()}\n")
        return UserError.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
