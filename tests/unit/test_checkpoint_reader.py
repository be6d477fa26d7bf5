"""FastFileSystemReader loads exactly what stock ``dcp.load`` loads (bit for bit)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from kfp_nvrx.components.launch.local.run import free_port
from kfp_nvrx.components.training.checkpoint import reader as cr


@dataclasses.dataclass
class Meta:
    name: str
    sizes: tuple


@pytest.fixture()
def pg():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _assert_same(a, b, where="") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(_bits(a), _bits(b)), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _source() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(40, 24, generator=g)
    return {
        "model": {
            "w": torch.randn(64, 32, generator=g),
            "bf16": torch.randn(33, 17, generator=g).to(torch.bfloat16),
            "f16_t": torch.randn(8, 12, generator=g).half().t(),  # transposed, non-contiguous
            "cols": base[:, ::3],  # strided
            "rows": base[5:19],  # storage offset
            "expanded": torch.randn(1, 6, generator=g).expand(4, 6),
            "i64": torch.randint(-(2**40), 2**40, (129,), generator=g),
            "u8": torch.randint(0, 256, (1000,), generator=g, dtype=torch.uint8),
            "flags": torch.rand(17, generator=g) > 0.5,
            "scalar": torch.tensor(3.25),
            "empty": torch.zeros(0, 3),
            "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
        },
        "optim": {"state": {"0": {"step": torch.tensor(7.0), "exp_avg": torch.randn(3, 5, generator=g)}},
                  "param_groups": [{"lr": 1e-3, "betas": [0.9, 0.95], "params": ["w"]}]},
        "train": {"step": 6, "name": "run", "ratio": 0.5, "meta": Meta("x", (1, 2)),
                  "hist": [1, 2, {"deep": [3, 4]}], "none": None},
    }


def _target(src: dict) -> dict:
    """Same structure, tensors zeroed (contiguous), python values replaced."""
    def blank(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros(v.shape, dtype=v.dtype)
        if isinstance(v, dict):
            return {k: blank(x) for k, x in v.items()}
        if isinstance(v, list):
            return [blank(x) for x in v]
        return None
    return blank(src)


def _stock_and_fast(path: Path, make_target, **reader_kwargs) -> tuple[dict, dict]:
    stock, fast = make_target(), make_target()
    dcp.load(stock, storage_reader=dcp.FileSystemReader(path))
    cr.load(fast, path, **reader_kwargs)
    return stock, fast


@pytest.mark.parametrize("kwargs", [{}, {"chunk_bytes": 4096, "num_threads": 3},
                                    {"chunk_bytes": 1, "num_threads": 1, "max_buffer_bytes": 1024}])
def test_matches_stock_load_bitwise(pg, tmp_path: Path, kwargs: dict) -> None:
    src = _source()
    dcp.save(src, checkpoint_id=tmp_path)
    stock, fast = _stock_and_fast(tmp_path, lambda: _target(src), **kwargs)
    _assert_same(stock, fast)
    _assert_same(src, fast)
    assert fast["train"]["meta"] == Meta("x", (1, 2))


def test_fallback_paths_match(pg, tmp_path: Path, monkeypatch) -> None:
    src = _source()
    dcp.save(src, checkpoint_id=tmp_path)
    monkeypatch.setattr(cr, "_load_torch_save", lambda *a: None)  # per-item torch.load from memory
    _, fast = _stock_and_fast(tmp_path, lambda: _target(src))
    _assert_same(src, fast)
    monkeypatch.setattr(cr, "_FAST", False)  # whole stock read_data
    _, fast = _stock_and_fast(tmp_path, lambda: _target(src))
    _assert_same(src, fast)


def test_subset_of_keys_reads_only_their_bytes(pg, tmp_path: Path, monkeypatch) -> None:
    g = torch.Generator().manual_seed(1)
    src = {f"t{i}": torch.randn(256, 64 + i, generator=g) for i in range(12)}
    dcp.save(src, checkpoint_id=tmp_path)
    md = dcp.FileSystemReader(tmp_path).read_metadata()
    want = {k: torch.zeros_like(v) for k, v in src.items() if int(k[1:]) % 3 == 1}
    need = sum(info.length for idx, info in md.storage_data.items() if idx.fqn in want)
    reads: list[tuple[int, int]] = []
    real = os.preadv

    def spy(fd, buffers, offset):
        n = real(fd, buffers, offset)
        reads.append((offset, n))
        return n

    monkeypatch.setattr(cr, "MAX_GAP", 0)
    monkeypatch.setattr(cr.os, "preadv", spy)
    cr.load(want, tmp_path)
    monkeypatch.undo()
    assert sum(n for _, n in reads) == need < (tmp_path / "__0_0.distcp").stat().st_size // 2
    for k, v in want.items():
        assert torch.equal(_bits(v), _bits(src[k])), k


@pytest.mark.parametrize("damage", ["truncated", "empty", "zeroed"])
def test_damaged_file_raises(pg, tmp_path: Path, damage: str) -> None:
    src = {"a": torch.randn(1000), "b": torch.randn(1000), "n": 3}
    dcp.save(src, checkpoint_id=tmp_path)
    f = tmp_path / "__0_0.distcp"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        if damage == "zeroed":  # same size, the items' zip directories overwritten
            fh.write(bytes(size))
        else:
            fh.truncate(size - 100 if damage == "truncated" else 0)
    match = "ends at byte" if damage != "zeroed" else None
    with pytest.raises(CheckpointException, match=match):  # a BaseException
        cr.load({"a": torch.zeros(1000), "b": torch.zeros(1000), "n": 0}, tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pin", [None, False])
def test_cuda_targets(pg, tmp_path: Path, pin) -> None:
    src = _source()
    dcp.save(src, checkpoint_id=tmp_path)

    def cuda_target() -> dict:
        t = _target(src)
        t["model"] = {k: v.cuda() for k, v in t["model"].items()}
        return t

    stock, fast = _stock_and_fast(tmp_path, cuda_target, chunk_bytes=8192, pin_memory=pin)
    assert fast["model"]["w"].is_cuda
    _assert_same(stock, fast)
    _assert_same(src, fast)


_TWO_RANKS = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from kfp_nvrx.components.training.checkpoint import reader as cr

    def full():
        g = torch.Generator().manual_seed(0)
        return {"w": torch.randn(7, 10, generator=g), "e": torch.randn(5, 6, generator=g).bfloat16(),
                "v": torch.arange(9)}

    def main(rank, world, ckpt, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        src = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full().items()}
        dcp.save({"model": src, "step": 3}, checkpoint_id=ckpt)
        def target():  # resharded: columns instead of rows, replicated 1-D
            return {"model": {k: distribute_tensor(torch.zeros_like(v), mesh,
                                                   [Shard(1) if v.dim() == 2 else Replicate()])
                              for k, v in full().items()}, "step": 0}
        stock, fast = target(), target()
        dcp.load(stock, storage_reader=dcp.FileSystemReader(ckpt))
        cr.load(fast, ckpt, chunk_bytes=1024)
        assert fast["step"] == 3
        for k, v in full().items():
            a, b = stock["model"][k].to_local(), fast["model"][k].to_local()
            assert torch.equal(a.view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)), k
            assert torch.equal(fast["model"][k].full_tensor(), v), k
        if rank == 0:
            torch.save(full(), os.path.join(os.path.dirname(ckpt), "full.pt"))
        dist.destroy_process_group()

    if __name__ == "__main__":
        import torch.multiprocessing as mp
        mp.spawn(main, args=(2, sys.argv[1], int(sys.argv[2])), nprocs=2)
""")


@pytest.mark.slow
def test_two_rank_checkpoint_resharded(pg, tmp_path: Path) -> None:
    """2 ranks save row shards, reload as column shards; this 1-rank process loads it whole."""
    ckpt = tmp_path / "ckpt"
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    proc = subprocess.run([sys.executable, str(script), str(ckpt), str(free_port())],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    full = torch.load(tmp_path / "full.pt")

    def target() -> dict:
        return {"model": {k: torch.zeros_like(v) for k, v in full.items()}, "step": 0}

    for kwargs in ({}, {"chunk_bytes": 64, "num_threads": 4}):
        stock, fast = _stock_and_fast(ckpt, target, **kwargs)
        _assert_same(stock, fast)
        _assert_same({"model": full, "step": 3}, fast)
