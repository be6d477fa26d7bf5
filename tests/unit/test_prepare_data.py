"""prepare-data: token shards, index.json contract, fingerprint reuse, errors, CLI."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kfp_nvrx.components.cli import main as cli
from kfp_nvrx.components.data.prepare import Recipe, prepare_dataset
from kfp_nvrx.components.data.sample import sample_documents, write_sample_corpus
from kfp_nvrx.components.data.shards import SplitTokens, read_index, verify_checksums
from kfp_nvrx.components.data.sources import iter_documents
from kfp_nvrx.components.data.tokenize import ByteTokenizer, dtype_for_vocab
from kfp_nvrx.components.errors import UserError


def _docs_of(split: SplitTokens, eos: int = 0) -> list[bytes]:
    """Splits a split's token stream at eos back into documents (as UTF-8 bytes)."""
    data = split.read(0, len(split))
    assert data[-1] == eos, "every document ends with eos"
    ends = np.flatnonzero(data == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [bytes(data[s:e].astype(np.uint8)) for s, e in zip(starts, ends, strict=True)]


def _listing(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()}


@pytest.fixture()
def corpus(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    write_sample_corpus(src, n_docs=200, seed=1)
    return src


def test_sample_corpus_is_deterministic_and_english_like(tmp_path: Path) -> None:
    a = write_sample_corpus(tmp_path / "a", seed=0)
    b = write_sample_corpus(tmp_path / "b", seed=0)
    c = write_sample_corpus(tmp_path / "c", seed=1)
    assert [p.name for p in a] == ["sample.txt", "sample.jsonl"]
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]
    assert a[0].read_bytes() != c[0].read_bytes()
    size = sum(p.stat().st_size for p in a)
    assert 200_000 < size < 600_000
    docs = sample_documents(50, seed=0)
    assert all(d.endswith(".") and "\n" not in d for d in docs)
    # The facts are consistent: a person always lives in the same city.
    cities: dict[str, set[str]] = {}
    for doc in sample_documents(400, seed=0):
        for sent in doc.split(". "):
            if " lives in " in sent:
                who, where = sent.rstrip(".").split(" lives in ")
                cities.setdefault(who, set()).add(where)
    assert cities and all(len(v) == 1 for v in cities.values())


def test_prepare_writes_contract_format(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    res = prepare_dataset(str(corpus), out, Recipe(val_fraction=0.1, seed=3), seq_len=32)
    assert res["status"] == "written"
    index = json.loads((out / "index.json").read_text())
    assert "status" not in index and "path" not in index
    assert index["format"] == "kfp-nvrx-tokens/1"
    assert (index["tokenizer"], index["vocab_size"], index["eos_id"], index["dtype"]) == (
        "byte", 256, 0, "uint8")
    assert index["seq_len"] == 32 and len(index["fingerprint"]) == 64
    docs = [d for f in sorted(corpus.iterdir()) for d in iter_documents(f)]
    assert len(docs) == 200
    # Exact token accounting: UTF-8 bytes of every document plus one eos each.
    total = sum(len(d.encode()) + 1 for d in docs)
    splits = index["splits"]
    assert splits["train"]["tokens"] + splits["val"]["tokens"] == total
    assert splits["val"]["docs"] == 20 and splits["train"]["docs"] == 180
    for name, entry in splits.items():
        assert entry["tokens"] == sum(s["tokens"] for s in entry["shards"])
        for shard in entry["shards"]:
            assert shard["file"].startswith(f"{name}_") and shard["file"].endswith(".bin")
            raw = (out / shard["file"]).read_bytes()
            assert len(raw) == shard["tokens"]
            assert hashlib.sha256(raw).hexdigest() == shard["sha256"]
    assert verify_checksums(out) == []
    # Split by document: the union of both splits is exactly the corpus, order kept within a split.
    train = _docs_of(SplitTokens(out, "train"))
    val = _docs_of(SplitTokens(out, "val"))
    encoded = [d.encode() for d in docs]
    assert sorted(train + val) == sorted(encoded)
    assert train == [d for d in encoded if d in set(train)]
    assert not set(train) & set(val)
    # Nothing but the dataset in the parent (the temporary directory was renamed away).
    assert _listing(tmp_path) == {"src", "ds"}
    assert oct(out.stat().st_mode & 0o777) != oct(0o700)


def test_split_is_deterministic_from_seed(corpus: Path, tmp_path: Path) -> None:
    a = prepare_dataset(str(corpus), tmp_path / "a", Recipe(seed=5, val_fraction=0.1), seq_len=16)
    b = prepare_dataset(str(corpus), tmp_path / "b", Recipe(seed=5, val_fraction=0.1), seq_len=16)
    c = prepare_dataset(str(corpus), tmp_path / "c", Recipe(seed=6, val_fraction=0.1), seq_len=16)
    assert a["fingerprint"] == b["fingerprint"] != c["fingerprint"]
    val = [(tmp_path / d / "val_00000.bin").read_bytes() for d in "abc"]
    assert val[0] == val[1] != val[2]
    total = [r["splits"]["train"]["tokens"] + r["splits"]["val"]["tokens"] for r in (a, c)]
    assert total[0] == total[1]


def test_same_fingerprint_is_skipped_changed_source_refused(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    first = prepare_dataset(str(corpus), out, seq_len=16)
    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    again = prepare_dataset(str(corpus), out, seq_len=16)
    assert again["status"] == "skipped" and again["fingerprint"] == first["fingerprint"]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp
    with open(corpus / "sample.txt", "a", encoding="utf-8") as fh:
        fh.write("\nA new document about a new fox.\n")
    with pytest.raises(UserError) as err:
        prepare_dataset(str(corpus), out, seq_len=16)
    assert err.value.field == "out_dir" and "different dataset" in err.value.message
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp
    new = prepare_dataset(str(corpus), out, seq_len=16, overwrite=True)
    assert new["status"] == "written" and new["fingerprint"] != first["fingerprint"]
    assert read_index(out)["fingerprint"] == new["fingerprint"]
    assert _listing(tmp_path) == {"src", "ds"}


def test_damaged_dataset_is_rebuilt(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    prepare_dataset(str(corpus), out, seq_len=16)
    (out / "val_00000.bin").unlink()
    assert prepare_dataset(str(corpus), out, seq_len=16)["status"] == "written"
    assert verify_checksums(out) == []


def test_small_shards_and_reads_across_boundaries(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    index = prepare_dataset(str(corpus), out, Recipe(shard_bytes=4096), seq_len=16)
    shards = index["splits"]["train"]["shards"]
    assert len(shards) > 5 and all(s["tokens"] <= 4096 for s in shards)
    assert [s["file"] for s in shards] == [f"train_{i:05d}.bin" for i in range(len(shards))]
    whole = np.concatenate([np.fromfile(out / s["file"], dtype="<u1") for s in shards])
    split = SplitTokens(out, "train")
    assert len(split) == whole.size == index["splits"]["train"]["tokens"]
    assert np.array_equal(split.read(4000, 300), whole[4000:4300])
    with pytest.raises(IndexError):
        split.read(len(split) - 5, 10)


def test_jsonl_text_field_nul_bytes_and_txt_paragraphs(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text(
        json.dumps({"body": "x\u0000y " * 40}) + "\n\n" + json.dumps({"body": "é" * 50}) + "\n")
    (src / "b.txt").write_text("para one\nline two\n\n\n  \npara two " + "z" * 60 + "\n")
    (src / "ignored.csv").write_text("not,read\n")
    res = prepare_dataset(str(src), tmp_path / "ds",
                          Recipe(text_field="body", val_fraction=0.3, seed=0), seq_len=8)
    docs = sorted(_docs_of(SplitTokens(tmp_path / "ds", "train"))
                  + _docs_of(SplitTokens(tmp_path / "ds", "val")))
    assert docs == sorted([b"xy " * 40, "é".encode() * 50, b"para one\nline two",
                           b"para two " + b"z" * 60])
    assert res["splits"]["val"]["docs"] == 1


def test_glob_source(corpus: Path, tmp_path: Path) -> None:
    res = prepare_dataset(str(corpus / "*.jsonl"), tmp_path / "ds", seq_len=16)
    jsonl_docs = list(iter_documents(corpus / "sample.jsonl"))
    assert res["splits"]["train"]["docs"] + res["splits"]["val"]["docs"] == len(jsonl_docs)


def test_sample_scheme(tmp_path: Path) -> None:
    res = prepare_dataset("sample:", tmp_path / "ds")
    assert res["status"] == "written" and res["splits"]["train"]["tokens"] > 200_000
    assert prepare_dataset("sample:", tmp_path / "ds")["status"] == "skipped"
    small = prepare_dataset("sample:100", tmp_path / "small", seq_len=16)
    assert small["splits"]["train"]["docs"] + small["splits"]["val"]["docs"] == 100


def _bad(tmp_path: Path, field: str, source: str, seq_len: Any = 64, **recipe: Any) -> str:
    before = _listing(tmp_path)
    with pytest.raises(UserError) as err:
        prepare_dataset(source, tmp_path / "out", Recipe(**recipe), seq_len=seq_len)
    assert err.value.field == field, err.value
    assert "\n" not in err.value.one_line()
    assert _listing(tmp_path) == before, "a failed run leaves nothing behind"
    return err.value.message


def test_bad_inputs_name_the_field_and_leave_nothing(corpus: Path, tmp_path: Path) -> None:
    src = str(corpus)
    assert "does not exist" in _bad(tmp_path, "source", str(tmp_path / "missing"))
    assert "is required" in _bad(tmp_path, "source", " ")
    (tmp_path / "empty").mkdir()
    assert "holds no" in _bad(tmp_path, "source", str(tmp_path / "empty"))
    assert "matches no" in _bad(tmp_path, "source", str(tmp_path / "*.nothing"))
    (tmp_path / "data.csv").write_text("a,b\n")
    assert "unsupported" in _bad(tmp_path, "source", str(tmp_path / "data.csv"))
    (tmp_path / "blank.txt").write_text("\n \n\n")
    assert "2 are needed" in _bad(tmp_path, "source", str(tmp_path / "blank.txt"))
    (tmp_path / "bin.txt").write_bytes(b"ok\n\xff\xfe\n")
    assert "not UTF-8" in _bad(tmp_path, "source", str(tmp_path / "bin.txt"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken\n')
    assert f"{bad}:2:" in _bad(tmp_path, "source", str(bad))
    bad.write_text('{"text": "fine"}\n["a list"]\n')
    assert f"{bad}:2:" in _bad(tmp_path, "source", str(bad))
    bad.write_text('{"text": "fine"}\n\n{"content": "x"}\n')
    assert f"{bad}:3:" in _bad(tmp_path, "text_field", str(bad))
    for frac in (0, 1, 1.5, -0.1, True):
        _bad(tmp_path, "val_fraction", src, val_fraction=frac)
    for seq in (0, -4, 2.5):
        _bad(tmp_path, "seq_len", src, seq_len=seq)
    _bad(tmp_path, "text_field", src, text_field="")
    _bad(tmp_path, "seed", src, seed=-1)
    # val split shorter than seq_len + 1 names val_fraction; train too short names source.
    assert "raise val_fraction" in _bad(tmp_path, "val_fraction", src, seq_len=100_000,
                                        val_fraction=0.01)
    assert "train split" in _bad(tmp_path, "source", src, seq_len=1000, val_fraction=0.99)
    _bad(tmp_path, "tokenizer", src, tokenizer=str(tmp_path / "nope.json"))
    _bad(tmp_path, "eos_token", src, eos_token="</s>")
    _bad(tmp_path, "source", "sample:lots")


def test_foreign_out_dir_is_refused(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    with pytest.raises(UserError) as err:
        prepare_dataset(str(corpus), out, seq_len=16)
    assert err.value.field == "out_dir"
    assert (out / "notes.md").read_text() == "mine"
    with pytest.raises(UserError) as err:  # --overwrite replaces only a dataset of ours
        prepare_dataset(str(corpus), out, seq_len=16, overwrite=True)
    assert err.value.field == "out_dir" and sorted(p.name for p in out.iterdir()) == ["notes.md"]
    # An existing empty directory (e.g. a pre-created artifact dir) is simply filled.
    (tmp_path / "empty").mkdir()
    assert prepare_dataset(str(corpus), tmp_path / "empty", seq_len=16)["status"] == "written"


def test_dtype_for_vocab() -> None:
    assert dtype_for_vocab(256) == "uint8"
    assert dtype_for_vocab(257) == "uint16"
    assert dtype_for_vocab(65536) == "uint16"
    assert dtype_for_vocab(65537) == "uint32"


def test_byte_tokenizer_roundtrip() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo\u0000!")
    assert ids.tolist() == list("héllo!".encode())
    assert tok.decode(ids) == "héllo!"


def _word_tokenizer(path: Path, docs: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>"])
    tok.train_from_iterator(docs, trainer)
    # Pad the vocabulary past 256 so the dataset needs uint16.
    tok.add_tokens([f"extra{i}" for i in range(300)])
    tok.save(str(path))
    return path


def test_tokenizer_json(corpus: Path, tmp_path: Path) -> None:
    docs = [d for f in sorted(corpus.iterdir()) for d in iter_documents(f)]
    tj = _word_tokenizer(tmp_path / "tokenizer.json", docs)
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tj))
    out = tmp_path / "ds"
    res = prepare_dataset(str(corpus), out, Recipe(tokenizer=str(tj), val_fraction=0.1), seq_len=16)
    eos = hf.token_to_id("<|endoftext|>")
    sha = hashlib.sha256(tj.read_bytes()).hexdigest()
    assert res["tokenizer"] == f"tokenizer.json@sha256:{sha}"
    assert (res["vocab_size"], res["eos_id"], res["dtype"]) == (hf.get_vocab_size(), eos, "uint16")
    data = SplitTokens(out, "train").read(0, len(SplitTokens(out, "train")))
    assert data.max() < res["vocab_size"]
    first = data[: int(np.flatnonzero(data == eos)[0])]
    assert hf.decode(first.tolist()) in [" ".join(hf.encode(d).tokens) for d in docs]
    # --eos-token picks another special token; the fingerprint changes with it.
    other = prepare_dataset(str(corpus), tmp_path / "ds2",
                            Recipe(tokenizer=str(tj), val_fraction=0.1, eos_token="[UNK]"), seq_len=16)
    assert other["eos_id"] == hf.token_to_id("[UNK]")
    assert other["fingerprint"] != res["fingerprint"]
    with pytest.raises(UserError) as err:
        prepare_dataset(str(corpus), tmp_path / "ds3", Recipe(tokenizer=str(tj), eos_token="</s>"))
    assert err.value.field == "eos_token"
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(UserError) as err:
        prepare_dataset(str(corpus), tmp_path / "ds3", Recipe(tokenizer=str(tmp_path / "junk.json")))
    assert err.value.field == "tokenizer" and "not a valid tokenizer.json" in err.value.message


def test_tokenizers_package_missing_is_a_user_error(corpus: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now raises ImportError
    with pytest.raises(UserError) as err:
        prepare_dataset(str(corpus), tmp_path / "ds", Recipe(tokenizer=str(tmp_path / "tokenizer.json")))
    assert err.value.field == "tokenizer" and "pip install" in err.value.message


@pytest.fixture()
def only_prepare_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real CLI entry point with just this command registered (others are tested apart)."""
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("kfp_nvrx.components.cli.commands.prepare_data",))


def test_cli_prepare_data(only_prepare_cli: None, tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ds"
    argv = ["prepare-data", "--source", "sample:300", "--out", str(out), "--seq-len", "32"]
    assert cli.main(argv) == 0
    line = capsys.readouterr().out.strip()
    fp = read_index(out)["fingerprint"]
    assert line.startswith("dataset written:") and fp[:12] in line and "\n" not in line
    assert "vocab=256" in line and "dtype=uint8" in line and "train=" in line and "val=" in line
    assert cli.main(argv) == 0
    assert capsys.readouterr().out.startswith("dataset skipped:")
    rc = cli.main(["prepare-data", "--source", "sample:", "--out", str(tmp_path / "x"),
                   "--val-fraction", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "--val-fraction" in err
    assert "Traceback" not in err and not (tmp_path / "x").exists()
    rc = cli.main(["prepare-data", "--source", str(tmp_path / "nope"), "--out", str(out)])
    assert rc == 2 and "--source" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["ds"]


def test_out_dir_that_cannot_be_renamed_is_filled_in_place(
        corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A mount point (volume, artifact dir) cannot be renamed: its entries are replaced instead."""
    import errno

    out = tmp_path / "mnt"
    out.mkdir()
    real_replace = os.replace

    def replace(src: str | Path, dst: str | Path) -> None:
        if Path(src) == out or Path(dst) == out:
            raise OSError(errno.EBUSY, "Device or resource busy")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    first = prepare_dataset(str(corpus), out, Recipe(shard_bytes=64), seq_len=16)
    assert first["status"] == "written" and verify_checksums(out) == []
    assert len(first["splits"]["train"]["shards"]) > 1
    second = prepare_dataset(str(corpus), out, Recipe(seed=1), seq_len=16, overwrite=True)
    assert read_index(out)["fingerprint"] == second["fingerprint"] != first["fingerprint"]
    # The first dataset's extra shards (ours) went; exactly the second one's files are left.
    assert {p.name for p in out.iterdir()} == {"index.json"} | {
        s["file"] for split in second["splits"].values() for s in split["shards"]}
    assert verify_checksums(out) == []
    (out / "notes.md").write_text("mine")  # a foreign file stops even --overwrite
    with pytest.raises(UserError):
        prepare_dataset(str(corpus), out, Recipe(seed=2), seq_len=16, overwrite=True)
    assert (out / "notes.md").read_text() == "mine"
    (out / "notes.md").unlink()
    assert _listing(tmp_path) == {"src", "mnt"}
