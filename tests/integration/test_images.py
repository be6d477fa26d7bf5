"""The two Dockerfiles and the image references, checked the way a reviewer would without building.

There is no Docker engine on these machines (the ``docker`` CLI has no daemon to talk to), so no
image is built or run here. Instead each Dockerfile is parsed with dockerfile-parse and checked:
pinned bases and versions, every ``COPY`` source exists and survives the Dockerfile's own
``.dockerignore``, no build tools installed in the final stage. The wheel stage is then replayed on
the host (exactly the files its ``COPY`` lines send, the same ``pip wheel``), and that wheel is
installed with the trainer and launcher extras into a fresh venv, where ``ft_launcher --help`` and
``python -m kfp_nvrx.components.training.trainer --help`` must run.
"""

from __future__ import annotations

import configparser
import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from kfp_nvrx.components import __version__
from kfp_nvrx.components import images as img

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {
    "trainer": ROOT / "images/trainer/Dockerfile",
    "components": ROOT / "images/components/Dockerfile",
}
#: The extras each image installs (each must exist in setup.cfg). The trainer image also runs the
#: export/compare components (they need torch), so it carries the launcher extra (kfp) too.
EXTRAS = {"trainer": "trainer,launcher", "components": "launcher"}
#: apt packages that are build tools: none may be installed in a final stage.
BUILD_TOOLS = re.compile(
    r"^(gcc|g\+\+|cpp|clang|make|cmake|ninja-build|build-essential|autoconf|automake|libtool"
    r"|pkg-config|dpkg-dev|.*-dev)(=.*)?$"
)


# --------------------------------------------------------------------------------------------
# Dockerfile model: stages with their instructions and resolved ARG defaults.
# --------------------------------------------------------------------------------------------
def _subst(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), text)


def _arg(value: str) -> tuple[str, str]:
    name, _, default = value.partition("=")
    return name.strip(), default.strip().strip('"')


def stages(path: Path) -> list[dict]:
    """Split a Dockerfile into stages: name, resolved base, ARG defaults, instructions."""
    parser = DockerfileParser(path=str(path))
    global_args: dict[str, str] = {}
    out: list[dict] = []
    for ins in parser.structure:
        kind, value = ins["instruction"], ins["value"]
        if kind == "FROM":
            m = re.fullmatch(r"(?:--\S+\s+)*(\S+)(?:\s+as\s+(\S+))?", value.strip(), re.I)
            assert m, f"cannot parse FROM {value}"
            out.append({"base": _subst(m[1], global_args), "name": m[2] or "",
                        "args": dict(global_args), "ins": []})
        elif kind == "ARG" and not out:
            name, default = _arg(value)
            global_args[name] = default
        elif out:
            if kind == "ARG":
                name, default = _arg(value)
                out[-1]["args"][name] = default
            out[-1]["ins"].append((kind, value))
    return out


def runs(stage: dict) -> list[str]:
    """The stage's RUN commands with its ARG defaults substituted (mount flags kept)."""
    return [_subst(v, stage["args"]) for k, v in stage["ins"] if k == "RUN"]


def dockerignore(path: Path) -> list[tuple[bool, re.Pattern]]:
    """(negated, regex) per line of ``<Dockerfile>.dockerignore`` (BuildKit's per-file ignore)."""
    ignore = path.with_name(path.name + ".dockerignore")
    out = []
    for line in ignore.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        pat = line.lstrip("!").strip("/")
        rx = "".join(
            ".*" if tok == "**" else "[^/]*" if tok == "*" else "[^/]" if tok == "?"
            else re.escape(tok) for tok in re.split(r"(\*\*|\*|\?)", pat))
        out.append((neg, re.compile(rx.replace(".*/", "(.*/)?"))))
    return out


def excluded(rel: str, patterns: list[tuple[bool, re.Pattern]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    result = False
    for neg, rx in patterns:
        if any(rx.fullmatch(p) for p in prefixes):
            result = not neg
    return result


def context_copies(path: Path) -> list[tuple[list[str], str]]:
    """(sources, dest) of every COPY/ADD that reads the build context (no ``--from``)."""
    out = []
    for stage in stages(path):
        for kind, value in stage["ins"]:
            if kind in ("COPY", "ADD") and "--from=" not in value:
                tokens = [t for t in value.split() if not t.startswith("--")]
                out.append((tokens[:-1], tokens[-1]))
    return out


# --------------------------------------------------------------------------------------------
# Static checks
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", DOCKERFILES)
def test_every_base_is_pinned(name: str) -> None:
    names = set()
    for stage in stages(DOCKERFILES[name]):
        base = stage["base"]
        if base in names:  # FROM an earlier stage
            continue
        assert "$" not in base, f"unresolved ARG in FROM {base}"
        repo, sep, tag = base.rpartition(":")
        assert sep and "/" not in tag, f"{base}: no explicit tag"
        assert tag != "latest" and re.search(r"\d+\.\d+", tag), f"{base}: floating tag"
        names.add(stage["name"])
    assert names, "no FROM found"


def test_trainer_base_is_ngc_pytorch_and_builder_python_patch_pinned() -> None:
    bases = [s["base"] for s in stages(DOCKERFILES["trainer"])]
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3", bases[-1])
    comp = [s["base"] for s in stages(DOCKERFILES["components"])]
    for base in (bases[0], *comp):
        assert re.fullmatch(r"python:3\.\d+\.\d+-slim-bookworm", base), base


def _version(text: str) -> tuple[int, ...]:
    assert re.fullmatch(r"\d+\.\d+\.\d+", text), f"{text!r} is not an exact x.y.z version"
    return tuple(int(p) for p in text.split("."))


def test_trainer_pins_efa_ofi_and_nvrx() -> None:
    final = stages(DOCKERFILES["trainer"])[-1]
    args = final["args"]
    # Field-note minimums for p5: EFA installer >= 1.29, aws-ofi-nccl >= 1.7.3.
    assert _version(args["EFA_INSTALLER_VERSION"]) >= (1, 29, 0)
    assert _version(args["AWS_OFI_NCCL_VERSION"]) >= (1, 7, 3)
    assert args["NVRX_VERSION"] == "0.7.0"
    cmds = " ".join(runs(final))
    efa = re.search(r"efa_installer\.sh ([^&;]*)", cmds)
    assert efa, "efa_installer.sh is not run in the final stage"
    assert set(efa[1].split()) >= {"-y", "--skip-kmod", "--skip-limit-conf", "--no-verify"}
    assert f"aws-efa-installer-{args['EFA_INSTALLER_VERSION']}.tar.gz" in cmds
    # The bundled plugin version is checked against the pin, so the two cannot disagree.
    assert f'grep -qxF "{args["AWS_OFI_NCCL_VERSION"]}"' in cmds
    assert f'"nvidia-resiliency-ext=={args["NVRX_VERSION"]}"' in cmds
    assert "command -v ft_launcher" in cmds and "command -v kfp-nvrx-ft-launcher" in cmds


@pytest.mark.parametrize("name", DOCKERFILES)
def test_final_stage_installs_no_build_tools(name: str) -> None:
    final = stages(DOCKERFILES[name])[-1]
    for cmd in runs(final):
        for m in re.finditer(r"apt(?:-get)? install((?:\s+[^&|;]+)*)", cmd):
            pkgs = [t for t in m[1].split() if not t.startswith("-")]
            assert not [p for p in pkgs if BUILD_TOOLS.match(p)], cmd
    # Our package comes in as a wheel with the image's extra; the extra must exist.
    extras = configparser.ConfigParser(interpolation=None)
    extras.read(ROOT / "setup.cfg")
    extra = EXTRAS[name]
    assert all(e in extras["options.extras_require"] for e in extra.split(","))
    assert re.search(rf"kfp_nvrx-\*\.whl\)\[{extra}\]", " ".join(runs(final)))


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copy_sources_exist_and_reach_the_build(name: str) -> None:
    patterns = dockerignore(DOCKERFILES[name])
    copies = context_copies(DOCKERFILES[name])
    assert copies
    for sources, _ in copies:
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert not excluded(src, patterns), f"COPY {src}: excluded by .dockerignore"
    # What the build needs: setup.cfg's package_dir folders, every `file:` it reads, setup.py.
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg")
    needed = {line.split("=")[1].strip() for line in
              cfg["options"]["package_dir"].strip().splitlines()}
    needed |= {v.split("file:")[1].strip() for v in cfg["metadata"].values() if "file:" in v}
    needed |= {"pyproject.toml", "setup.py"}  # setup.py finds the packages
    sent = {Path(s).as_posix().strip("/") for sources, _ in copies for s in sources}
    assert needed <= sent, f"not copied: {needed - sent}"


def test_component_image_carries_its_registry_for_the_trainer_image() -> None:
    # The training step names the PyTorchJob's image at run time from $KFP_NVRX_REGISTRY, so the
    # component image must carry the registry it was built for.
    final = stages(DOCKERFILES["components"])[-1]
    assert "KFP_NVRX_REGISTRY" in final["args"]
    envs = " ".join(v for k, v in final["ins"] if k == "ENV")
    assert re.search(r"\bKFP_NVRX_REGISTRY=\$\{KFP_NVRX_REGISTRY\}", envs)
    readme = (ROOT / "images/README.md").read_text()
    build = re.search(r"docker buildx build[^`]*?images/components/Dockerfile[^`]*? \.\n", readme)
    assert build and '--build-arg KFP_NVRX_REGISTRY="$KFP_NVRX_REGISTRY"' in build[0]


def test_dockerignore_matcher() -> None:
    patterns = dockerignore(DOCKERFILES["trainer"])
    assert excluded(".venv/bin/python", patterns)
    assert excluded("tests/integration/test_images.py", patterns)
    assert not excluded("components/images.py", patterns)
    assert excluded("components/__pycache__/images.cpython-311.pyc", patterns)


def test_image_refs_come_from_the_package_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(img.REGISTRY_ENV, raising=False)
    assert img.trainer_image() == f"{img.DEFAULT_REGISTRY}/kfp-nvrx-trainer:{__version__}"
    ecr = "123456789012.dkr.ecr.us-west-2.amazonaws.com/kfp-nvrx"
    monkeypatch.setenv(img.REGISTRY_ENV, ecr)
    assert img.components_image() == f"{ecr}/kfp-nvrx-components:{__version__}"
    assert img.image_tag("1.2.0+g1234") == "1.2.0-g1234"
    for bad in ("https://ghcr.io/x", "ghcr.io/x/", "ghcr.io/X", "ghcr.io/x:1.0", "a b"):
        with pytest.raises(img.UserError) as err:
            img.registry(bad)
        assert err.value.field == "registry"
    # The Dockerfile folder of every image kind exists: kinds and Dockerfiles cannot drift.
    assert {k: (ROOT / "images" / k / "Dockerfile").is_file() for k in img.IMAGES} == {
        k: True for k in img.IMAGES}


def test_images_cli_prints_reference_or_one_line_error() -> None:
    run = [sys.executable, "-m", "kfp_nvrx.components.images"]
    ok = subprocess.run([*run, "trainer", "--registry", "r.example/x"], capture_output=True,
                        text=True, check=True)
    assert ok.stdout == f"r.example/x/kfp-nvrx-trainer:{__version__}\n"
    bad = subprocess.run([*run, "trainer", "--registry", "https://r"], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1 and not bad.stdout
    assert bad.stderr.startswith("error: --registry: ")


# --------------------------------------------------------------------------------------------
# The wheel the images install, replayed from the Dockerfile's COPY lines, and a clean venv.
# --------------------------------------------------------------------------------------------
def replay_wheel_stage(dockerfile: Path, out: Path) -> Path:
    """Copy exactly what the wheel stage's COPY lines send, build the wheel as its RUN does."""
    stage = next(s for s in stages(dockerfile) if s["name"] == "wheel")
    patterns = dockerignore(dockerfile)
    ctx = out / "src"
    ctx.mkdir(parents=True)
    for kind, value in stage["ins"]:
        if kind != "COPY":
            continue
        tokens = [t for t in value.split() if not t.startswith("--")]
        sources, dest = tokens[:-1], ctx / tokens[-1]
        for src in sources:
            path = ROOT / src
            if path.is_dir():  # COPY of a directory copies its contents into dest
                for f in sorted(path.rglob("*")):
                    rel = f.relative_to(ROOT).as_posix()
                    if f.is_file() and not excluded(rel, patterns):
                        target = dest / f.relative_to(path)
                        target.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(f, target)
            else:
                target = dest / path.name if tokens[-1].endswith("/") else dest
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    assert any("pip wheel" in cmd and "--no-deps" in cmd for cmd in runs(stage))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(out / "dist"), str(ctx)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = (out / "dist").glob("kfp_nvrx-*.whl")
    return wheel


@pytest.fixture(scope="session")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("wheels")
    return {name: replay_wheel_stage(path, base / name) for name, path in DOCKERFILES.items()}


def _wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return sorted(zf.namelist())


def _metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(zf.read(name).decode())


def test_wheel_has_one_top_level_name_and_no_tests(wheels: dict[str, Path]) -> None:
    names = _wheel_names(wheels["trainer"])
    assert names == _wheel_names(wheels["components"]), "the two images ship different wheels"
    assert {n.split("/")[0] for n in names} == {"kfp_nvrx", f"kfp_nvrx-{__version__}.dist-info"}
    assert "kfp_nvrx/__init__.py" not in names  # kfp_nvrx is a namespace package
    assert not [n for n in names if "/tests/" in n or n.endswith("conftest.py")]
    assert "kfp_nvrx/components/images.py" in names


def test_wheel_version_is_the_image_tag_and_launcher_extra_has_no_torch(
        wheels: dict[str, Path]) -> None:
    meta = _metadata(wheels["components"])
    assert meta["Version"] == __version__ == img.image_tag()
    assert {"trainer", "launcher"} <= set(meta.get_all("Provides-Extra"))
    reqs = meta.get_all("Requires-Dist")
    no_gpu = [r for r in reqs if "extra ==" not in r or "'launcher'" in r or '"launcher"' in r]
    assert no_gpu and not [r for r in no_gpu if re.match(r"(torch|nvidia-resiliency-ext)\b", r)]


def _torch_pin() -> str:
    m = re.search(r"^TORCH_PIN \?= (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, "TORCH_PIN not found in the Makefile"
    return m[1]


@pytest.fixture(scope="session")
def venv(wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """A fresh venv with the replayed wheel and both extras (the CPU torch pin first)."""
    path = tmp_path_factory.mktemp("venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    # --no-compile: byte-compiling the ~9000 modules of torch and the CUDA wheels costs CPU the
    # checks never use (what they import is compiled as they import it).
    pip = [str(path / "bin/python"), "-m", "pip", "install", "-q",
           "--disable-pip-version-check", "--no-compile"]
    # Torch first, pinned (the build pip already has cached); unpinned, the trainer extra would
    # pull whatever torch is newest.
    subprocess.run([*pip, _torch_pin()], check=True, timeout=600)
    subprocess.run([*pip, f"{wheels['trainer']}[trainer,launcher]"], check=True, timeout=600)
    yield path
    shutil.rmtree(path, ignore_errors=True)  # about 1 GB


def _run(venv: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300,
                          env={"PATH": f"{venv}/bin:/usr/bin:/bin", "HOME": str(venv.parent),
                               "KFP_NVRX_REGISTRY": "r.example/team"})


@pytest.mark.slow
def test_venv_is_consistent_and_uses_the_cpu_torch(venv: Path) -> None:
    check = _run(venv, "python", "-m", "pip", "check")
    assert check.returncode == 0, check.stdout + check.stderr
    torch = _run(venv, "python", "-c", "import torch; print(torch.__version__)")
    # The pinned release; its local part (+cpu, +cu130) is whatever build the index serves for
    # this machine (PyPI's default wheel of 2.13.0 is a CUDA build that runs on the CPU).
    assert torch.stdout.strip().split("+")[0] == _torch_pin().split("==")[1]
    imports = _run(venv, "python", "-c",
                   "import kfp, kfp.kubernetes, kubeflow.training, kubeflow_trainer_api, "
                   "kubernetes, jsonschema")
    assert imports.returncode == 0, imports.stderr
    ref = _run(venv, "python", "-m", "kfp_nvrx.components.images", "components")
    assert ref.stdout.strip() == f"r.example/team/kfp-nvrx-components:{__version__}"


@pytest.mark.slow
def test_ft_launcher_on_path_knows_every_flag_we_pass(venv: Path) -> None:
    from kfp_nvrx.components.core.config import ResilienceConfig
    from kfp_nvrx.components.core.launch_command import TrainerArgs, ft_launcher_argv

    assert shutil.which("ft_launcher", path=str(venv / "bin"))
    helped = _run(venv, "ft_launcher", "--help")
    assert helped.returncode == 0, helped.stderr
    known = set(re.findall(r"--[a-z][a-z0-9-]*", helped.stdout))
    for res in (ResilienceConfig(), ResilienceConfig(monitor="heartbeats", in_process=True)):
        argv = ft_launcher_argv(res, TrainerArgs("tiny", "/tmp/run"), local_addr="10.0.0.1")
        ours = {a.split("=")[0] for a in argv[1:argv.index("-m")]}
        assert ours <= known, f"flags unknown to ft_launcher: {ours - known}"


@pytest.mark.slow
def test_trainer_module_help_runs(venv: Path) -> None:
    helped = _run(venv, "python", "-m", "kfp_nvrx.components.training.trainer", "--help")
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert "usage" in helped.stdout.lower() and "--config" in helped.stdout
