"""The launch-local preflight (``trainer --check``): torch only where a check needs it.

The preflight runs in a child interpreter before any agent starts. The dataset's index and
shards and a fresh run dir are checked without torch (seconds of imports on every launch, and
on every bad-input error); a machine without torch is still told to install the trainer.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kfp_nvrx.components.core.launch_command import TrainerArgs
from kfp_nvrx.components.errors import UserError
from kfp_nvrx.components.launch.local.preflight import preflight

# sitecustomize for the child: torch is found but fails to import, or is not there at all.
_BLOCK = '''
import importlib.abc, importlib.machinery, sys

class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        raise ImportError("torch imported by the preflight")

class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] != "torch":
            return None
        if {missing}:
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return importlib.machinery.ModuleSpec(name, _Loader())

sys.meta_path.insert(0, _Finder())
'''


def _blocked(tmp_path: Path, missing: bool) -> dict[str, str]:
    site = tmp_path / ("missing" if missing else "unimportable")
    site.mkdir()
    (site / "sitecustomize.py").write_text(_BLOCK.format(missing=missing))
    return {"PYTHONPATH": str(site)}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    from kfp_nvrx.components.data.prepare import prepare_dataset

    path = tmp_path_factory.mktemp("data") / "d"
    prepare_dataset("sample:60", path, seq_len=32)
    return str(path)


def test_a_fresh_run_on_a_good_dataset_is_checked_without_torch(tmp_path, data) -> None:
    args = TrainerArgs("tiny", str(tmp_path / "run"), [f"data.path={data}", "train.device=cpu"])
    preflight(args, _blocked(tmp_path, missing=False))
    assert not (tmp_path / "run").exists()  # the check writes nothing


def test_a_bad_dataset_is_refused_without_torch(tmp_path) -> None:
    args = TrainerArgs("tiny", str(tmp_path / "run"), [f"data.path={tmp_path}"])
    with pytest.raises(UserError) as err:
        preflight(args, _blocked(tmp_path, missing=False))
    assert err.value.field == "data.path" and "no index.json" in err.value.message


def test_a_machine_without_torch_is_told_to_install_the_trainer(tmp_path, data) -> None:
    args = TrainerArgs("tiny", str(tmp_path / "run"), [f"data.path={data}"])
    with pytest.raises(UserError) as err:
        preflight(args, _blocked(tmp_path, missing=True))
    assert err.value.field == "trainer"
    assert "pip install 'kfp-nvrx[trainer]'" in err.value.message, err.value.message
