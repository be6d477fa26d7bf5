"""The documented commands produce and refer to the same two image references.

A user follows ``docs/eks.md`` (or ``images/README.md``) to build and push the images, then runs
the compile, render-job and submit examples of those files and of the top-level README. If any of
them names another repository the worker pods end in ``ImagePullBackOff``. These tests take the
commands out of the markdown and run them:

- the build blocks run in bash with ``docker``/``aws``/``pip`` replaced by functions that record
  their arguments (no Docker engine or AWS account here); everything else in them (the exports,
  ``python -m kfp_nvrx.components.images``) runs for real;
- ``kfp-nvrx compile``, ``render-job`` and ``submit`` run for real (compile into a temporary
  directory, submit against the KFP API test double) and their output is checked for the pushed
  references;
- every literal ``.../kfp-nvrx-trainer:...`` written in the docs must be a pushed reference.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.kfp_api_double import KfpApiDouble

from kfp_nvrx.components import images

ROOT = Path(__file__).resolve().parents[2]
DOCS = {name: ROOT / name for name in ("README.md", "docs/eks.md", "images/README.md")}
BIN = Path(sys.executable).parent
#: The example account and region of docs/eks.md; ``<account>``/``<region>`` stand for them.
EXAMPLE = {"<account>": "123456789012", "<region>": "us-west-2"}
# A documented image reference: an ECR host, a path ending in one of our repositories, a tag.
IMAGE_RE = re.compile(r"[\w.<>-]+\.amazonaws\.com/[\w./-]*kfp-nvrx-(?:trainer|components):[\w.-]+")

# Commands that need an engine, an AWS account or a cluster: record them instead. Each call is
# one file of its own under $CALLS (named by time, pid and a random number, so they sort in call
# order): both ends of a pipe (`aws ecr get-login-password | docker login`) record at the same
# time, and records appended to one shared file interleaved under load.
STUBS = r"""
record() { printf '%s\037' "$@" > "$CALLS/$(date +%s%N).$BASHPID.$RANDOM"; }
docker() { record docker "$@"; cat > /dev/null; }
aws() { record aws "$@"; if [ "$1 $2" = "ecr get-login-password" ]; then echo not-a-password; fi; }
pip() { record pip "$@"; }
"""


def code_blocks(path: Path) -> list[str]:
    """Return the fenced shell blocks of a markdown file, continuation lines joined."""
    blocks = re.findall(r"^```(?:sh|bash)\n(.*?)^```", path.read_text(), flags=re.S | re.M)
    return [re.sub(r"\\\n\s*", "", b) for b in blocks]


def commands(path: Path, prefix: str) -> list[str]:
    """Return the documented command lines that start with ``prefix``, pipes to kubectl dropped."""
    found = []
    for block in code_blocks(path):
        for line in block.splitlines():
            if line.strip().startswith(prefix):
                found.append(re.sub(r"\s*\|\s*kubectl .*$", "", line.strip()))
    return found


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != images.REGISTRY_ENV}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # `python`, `kfp-nvrx`: this venv
    return {**env, **extra}


def argv(line: str, env: dict[str, str]) -> list[str]:
    """Expand one documented command line as the user's shell would (variables, $(...))."""
    done = subprocess.run(["bash", "-c", 'eval "set -- $CMD"; printf "%s\\0" "$@"'],
                          env={**env, "CMD": line}, capture_output=True, text=True, check=True)
    return done.stdout.split("\0")[:-1]


def run_build_block(doc: Path, tmp_path: Path) -> tuple[list[list[str]], dict[str, str]]:
    """Run the block of ``doc`` that builds the images; return the recorded calls and its env."""
    (block,) = [b for b in code_blocks(doc) if "docker buildx build" in b]
    calls, env_out = tmp_path / f"{doc.stem}.calls", tmp_path / f"{doc.stem}.env"
    calls.mkdir()
    script = f"set -euo pipefail\n{STUBS}\n{block}\nenv -0 > {env_out}\n"
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          env=clean_env(CALLS=str(calls)))
    assert done.returncode == 0, done.stderr
    recorded = recorded_calls(calls)
    env = dict(item.split("=", 1) for item in env_out.read_text().split("\0") if "=" in item)
    return recorded, env


def recorded_calls(calls: Path) -> list[list[str]]:
    """The stubs' records under ``calls``, in call order: one argument list per file."""
    return [f.read_text().split("\037")[:-1] for f in sorted(calls.iterdir())]


def test_stub_records_stay_whole_when_both_ends_of_a_pipe_record(tmp_path):
    """40 pipes whose two ends record at once: every record is one whole call, none is lost."""
    calls = tmp_path / "calls"
    calls.mkdir()
    long_arg = "x" * 3000  # longer than one write of a line-buffered shell builtin
    script = (f"set -euo pipefail\n{STUBS}\nfor i in $(seq 40); do\n"
              f"  (aws ecr get-login-password --region r$i | docker login --password-stdin "
              f"h$i {long_arg}) &\ndone\nwait\n")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                          env=clean_env(CALLS=str(calls)))
    assert done.returncode == 0, done.stderr
    got = sorted(map(tuple, recorded_calls(calls)))
    want = sorted([("aws", "ecr", "get-login-password", "--region", f"r{i}") for i in
                   range(1, 41)] + [("docker", "login", "--password-stdin", f"h{i}", long_arg)
                                    for i in range(1, 41)])
    assert got == want


def pushed_refs(calls: list[list[str]]) -> dict[str, str]:
    """Image kind (the Dockerfile's folder) -> the reference ``docker buildx build --push`` tags."""
    refs = {}
    for call in calls:
        if call[:3] == ["docker", "buildx", "build"]:
            assert "--push" in call, call
            kind = Path(call[call.index("-f") + 1]).parent.name
            refs[kind] = call[call.index("-t") + 1]
    return refs


@pytest.fixture(scope="module")
def pushed(tmp_path_factory) -> tuple[dict[str, str], dict[str, str]]:
    """What docs/eks.md pushes (kind -> reference) and the shell environment it leaves."""
    calls, env = run_build_block(DOCS["docs/eks.md"], tmp_path_factory.mktemp("eks"))
    return pushed_refs(calls), env


@pytest.mark.parametrize("doc", ["docs/eks.md", "images/README.md"])
def test_build_block_pushes_into_the_repositories_it_creates(doc, tmp_path, pushed):
    calls, env = run_build_block(DOCS[doc], tmp_path)
    refs = pushed_refs(calls)
    assert refs == pushed[0], f"{doc} pushes other images than docs/eks.md"
    registry = env[images.REGISTRY_ENV]
    assert refs == {kind: images.image_ref(kind, registry) for kind in images.IMAGES}
    repos = {c[c.index("--repository-name") + 1] for c in calls if c[:3] == ["aws", "ecr",
                                                                               "create-repository"]}
    hosts = {c[-1] for c in calls if c[:2] == ["docker", "login"]}
    for ref in refs.values():
        host, _, path = ref.rpartition(":")[0].partition("/")
        assert path in repos, f"{ref} is pushed to a repository the docs never create ({repos})"
        assert host in hosts, f"{ref} is pushed to a registry the docs never log in to"
    (build_arg,) = [c[c.index("--build-arg") + 1] for c in calls if "--build-arg" in c]
    assert build_arg == f"{images.REGISTRY_ENV}={registry}"


def test_every_written_image_reference_is_a_pushed_one(pushed):
    refs = set(pushed[0].values())
    assert refs and all(ref.endswith(":" + images.image_tag()) for ref in refs)
    for name, path in DOCS.items():
        text = path.read_text()
        for key, value in EXAMPLE.items():
            text = text.replace(key, value)
        for ref in IMAGE_RE.findall(text):
            assert ref in refs, f"{name} names {ref}; the build commands push {sorted(refs)}"


def compiled_images(spec: dict) -> tuple[set[str], str]:
    """(executor images, default of the trainer_image parameter) of a compiled pipeline."""
    execs = {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()}
    params = spec["root"]["inputDefinitions"]["parameters"]
    return execs, params["trainer_image"]["defaultValue"]


@pytest.mark.parametrize("doc", ["README.md", "docs/eks.md"])
def test_documented_compile_names_the_pushed_images(doc, tmp_path, pushed):
    refs, env = pushed
    (line,) = commands(DOCS[doc], "kfp-nvrx compile")
    args = argv(line, clean_env(**{images.REGISTRY_ENV: env[images.REGISTRY_ENV]}))
    # the last --out wins: never overwrite the shipped YAML; one pipeline is enough here
    args += ["--out", str(tmp_path), "--pipeline", "fsdp-train"]
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, env=clean_env())
    assert done.returncode == 0, done.stderr
    execs, trainer = compiled_images(
        next(yaml.safe_load_all((tmp_path / "fsdp-train.yaml").read_text())))
    assert execs == set(refs.values())
    assert trainer == refs["trainer"]


def test_documented_render_jobs_run_the_pushed_trainer(pushed, tmp_path):
    refs, env = pushed
    shell = clean_env(**{images.REGISTRY_ENV: env[images.REGISTRY_ENV]})
    lines = commands(DOCS["README.md"], "kfp-nvrx render-job") + commands(
        DOCS["docs/eks.md"], "kfp-nvrx render-job")
    assert len(lines) >= 3
    for line in lines:
        args = argv(line, shell)
        done = subprocess.run(args, capture_output=True, text=True, env=shell, cwd=tmp_path)
        assert done.returncode == 0, f"{line}\n{done.stderr}"
        out = (tmp_path / args[args.index("--out") + 1]).read_text() if "--out" in args \
            else done.stdout
        # The TrainingRuntime's container image is a template every TrainJob replaces with its
        # spec.trainer.image: what the pods pull comes from the jobs.
        jobs = [d for d in yaml.safe_load_all(out)
                if d and d["kind"] not in ("TrainingRuntime", "ClusterTrainingRuntime")]
        assert jobs and {d["kind"] for d in jobs} <= {"PyTorchJob", "TrainJob"}, line
        assert {ref for d in jobs for ref in _images(d)} == {refs["trainer"]}, line


def _images(obj: object) -> list[str]:
    """Every ``image:`` value anywhere in a manifest."""
    if isinstance(obj, dict):
        own = [obj["image"]] if isinstance(obj.get("image"), str) else []
        return own + [ref for v in obj.values() for ref in _images(v)]
    if isinstance(obj, list):
        return [ref for v in obj for ref in _images(v)]
    return []


@pytest.mark.parametrize("doc", ["README.md", "docs/eks.md"])
def test_documented_submit_sends_the_pushed_images(doc, pushed, tmp_path):
    refs, env = pushed
    (line,) = commands(DOCS[doc], "kfp-nvrx submit")
    args = argv(line, clean_env(**{images.REGISTRY_ENV: env[images.REGISTRY_ENV]}))
    with KfpApiDouble() as api:
        args[args.index("--host") + 1] = api.url
        # eks.md's submit relies on the exported KFP_NVRX_REGISTRY to compile for it
        run_env = clean_env(**{images.REGISTRY_ENV: env[images.REGISTRY_ENV]},
                            HOME=str(tmp_path))
        done = subprocess.run(args, capture_output=True, text=True, env=run_env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        (run,) = api.calls("POST", "/apis/v2beta1/runs")
    execs, trainer = compiled_images(run.body["pipeline_spec"]["pipeline_spec"]
                                     if "pipeline_spec" in run.body["pipeline_spec"]
                                     else run.body["pipeline_spec"])
    assert execs == set(refs.values())
    sent = run.body.get("runtime_config", {}).get("parameters", {})
    assert sent.get("trainer_image", trainer) == refs["trainer"], json.dumps(sent)
