"""Datasets: loading, errors, batches, and the generated tasks checked by independent evaluators."""

from __future__ import annotations

import hashlib
import io
import math
import statistics
from pathlib import Path

import pytest
import torch

from energydsl.errors import DataError, UserError
from energydsl.training import data as data_mod
from energydsl.training.data import (
    IGNORE_INDEX,
    SHAKESPEARE_SHA256,
    ListOpsConfig,
    download_shakespeare,
    find_shakespeare,
    load_dataset,
)
from energydsl.training.sampling import ByteCodec, CharCodec, IntCodec, WordCodec, codec_from_json


def _shakespeare_or_skip() -> Path:
    try:
        return find_shakespeare()
    except DataError:
        pytest.skip("tiny Shakespeare corpus not available")


# ------------------------------------------------------------------------------------------ text


def test_shakespeare_char_matches_nanogpt():
    _shakespeare_or_skip()
    ds = load_dataset("shakespeare_char")
    assert ds.vocab_size == 65
    assert (ds.train.numel(), ds.val.numel()) == (1003854, 111540)  # nanoGPT's prepare.py numbers
    assert ds.train.dtype == torch.long and ds.train.dim() == 1
    assert ds.decode(ds.encode("First Citizen:\n")) == "First Citizen:\n"
    assert ds.decode(ds.train[:14].tolist()) == "First Citizen:"


def test_shakespeare_checksum_is_the_local_file():
    path = _shakespeare_or_skip()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SHAKESPEARE_SHA256


def test_shakespeare_env_var_missing_file_names_the_path(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere" / "input.txt"
    monkeypatch.setenv("ENERGYDSL_SHAKESPEARE", str(missing))
    with pytest.raises(DataError) as err:
        load_dataset("shakespeare_char")
    assert str(missing) in err.value.message


def test_shakespeare_env_var_and_data_dir(monkeypatch, tmp_path):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("hello world\n" * 50)
    monkeypatch.setenv("ENERGYDSL_SHAKESPEARE", str(corpus))
    assert load_dataset("shakespeare_char").vocab_size == len(set("hello world\n"))
    monkeypatch.delenv("ENERGYDSL_SHAKESPEARE")
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text("abc\n" * 50)
    monkeypatch.setenv("ENERGYDSL_DATA_DIR", str(tmp_path))
    assert load_dataset("shakespeare_char").vocab_size == 4


def test_shakespeare_not_found_suggests_download(monkeypatch, tmp_path):
    monkeypatch.delenv("ENERGYDSL_SHAKESPEARE", raising=False)
    monkeypatch.setattr(data_mod, "_shakespeare_candidates", lambda: [tmp_path / f"x{i}" for i in range(5)])
    with pytest.raises(DataError) as err:
        load_dataset("shakespeare_char")
    assert "download" in (err.value.hint or "")


def test_download_verifies_checksum_without_network(monkeypatch, tmp_path):
    payload = b"not shakespeare"

    def fake_urlopen(url, timeout):
        return io.BytesIO(payload)

    monkeypatch.setattr(data_mod.urllib.request, "urlopen", fake_urlopen)
    with pytest.raises(DataError, match="checksum"):
        download_shakespeare(tmp_path / "a.txt")
    assert not (tmp_path / "a.txt").exists()
    good = download_shakespeare(tmp_path / "b.txt", sha256=hashlib.sha256(payload).hexdigest())
    assert good.read_bytes() == payload


def test_download_refuses_a_bad_destination_or_url_before_fetching(tmp_path):
    """A folder as `dest` fetched the whole corpus, then raised IsADirectoryError and left `dest.part` behind; a
    URL that is none (`""`) raised a bare ValueError. Fetched here from a file:// URL: urllib itself, no network."""
    source = tmp_path / "corpus.txt"
    source.write_bytes(b"to be or not to be")
    url, sha = source.as_uri(), hashlib.sha256(source.read_bytes()).hexdigest()
    (tmp_path / "folder").mkdir()
    (tmp_path / "a_file").write_text("x")
    for dest, says in ((tmp_path / "folder", "is a directory"), (tmp_path / "a_file" / "in.txt", "cannot write")):
        with pytest.raises(UserError, match=f"the download's destination .*{says}"):
            download_shakespeare(dest, url=url, sha256=sha)
    for bad in ("", "http://[::1"):
        with pytest.raises(DataError, match="cannot download"):
            download_shakespeare(tmp_path / "c.txt", url=bad, sha256=sha)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "corpus.txt", "folder"]
    assert not any((tmp_path / "folder").iterdir())
    assert download_shakespeare(tmp_path / "d" / "in.txt", url=url, sha256=sha).read_bytes() == source.read_bytes()

def test_bytes_dataset(tmp_path):
    path = tmp_path / "t.txt"
    text = "héllo wörld, " * 40
    path.write_text(text, encoding="utf-8")
    ds = load_dataset(f"bytes:{path}")
    raw = text.encode("utf-8")
    assert ds.vocab_size == 256
    assert ds.train.tolist() + ds.val.tolist() == list(raw)
    assert ds.train.numel() == int(len(raw) * 0.9)
    assert ds.decode(ds.encode("wörld")) == "wörld"


def test_chars_dataset_rejects_non_utf8(tmp_path):
    path = tmp_path / "bin.txt"
    path.write_bytes(b"\xff\xfe\x00abc" * 10)
    with pytest.raises(DataError) as err:
        load_dataset(f"chars:{path}")
    assert "bytes:" in (err.value.hint or "")
    assert load_dataset(f"bytes:{path}").vocab_size == 256


@pytest.mark.parametrize("kind", ["bytes", "chars"])
def test_missing_empty_and_directory_files(tmp_path, kind):
    missing = tmp_path / "missing.txt"
    with pytest.raises(DataError) as err:
        load_dataset(f"{kind}:{missing}")
    assert str(missing) in err.value.message
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DataError, match="empty"):
        load_dataset(f"{kind}:{empty}")
    with pytest.raises(DataError, match="directory"):
        load_dataset(f"{kind}:{tmp_path}")
    with pytest.raises(DataError, match="path"):
        load_dataset(f"{kind}:")


def test_unknown_dataset_and_options(tmp_path):
    with pytest.raises(DataError) as err:
        load_dataset("wikitext")
    assert "wikitext" in err.value.message and "listops" in (err.value.hint or "")
    with pytest.raises(DataError, match="max_dept"):
        load_dataset("listops", max_dept=3)
    with pytest.raises(DataError, match="not a valid int"):
        load_dataset("listops", max_depth="deep")
    path = tmp_path / "t.txt"
    path.write_text("abc" * 100)
    with pytest.raises(DataError, match="takes no options"):
        load_dataset(f"bytes:{path}", seed=1)


def test_text_batches_shift_and_determinism(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("".join(chr(97 + i % 26) for i in range(2000)))
    ds = load_dataset(f"chars:{path}")
    x, y = ds.get_batch("train", 4, 16, torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = ds.get_batch("train", 4, 16, torch.Generator().manual_seed(1))
    assert torch.equal(x, x2)
    with pytest.raises(DataError, match="split"):
        ds.get_batch("test", 4, 16)


def test_block_size_larger_than_split(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("x" * 100)  # val split: 10 tokens
    with pytest.raises(DataError) as err:
        load_dataset(f"bytes:{path}", block_size=32)
    assert "val" in err.value.message and "32" in err.value.message
    ds = load_dataset(f"bytes:{path}", block_size=8)
    with pytest.raises(DataError):
        ds.get_batch("val", 2, 10)


# --------------------------------------------------------------------------------------- ListOps


def _parse_listops(tokens: list[str]) -> tuple[int, int]:
    """Independent reference: evaluate a token list recursively; returns (value, depth)."""
    pos = 0

    def node() -> tuple[int, int]:
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok.isdigit():
            return int(tok), 0
        assert tok.startswith("["), tok
        args, depth = [], 0
        while tokens[pos] != "]":
            value, d = node()
            args.append(value)
            depth = max(depth, d)
        pos += 1
        assert 2 <= len(args)
        ops = {
            "[MAX": max,
            "[MIN": min,
            "[MED": lambda a: math.floor(statistics.median(a)),
            "[SM": lambda a: sum(a) % 10,
        }
        return ops[tok](args), depth + 1

    value, depth = node()
    assert pos == len(tokens), "trailing tokens"
    return value, depth


def _listops_rows(ds, split):
    rows = ds.split(split).view(-1, ds.seq_len + 1)
    out = []
    for row in rows.tolist():
        words = ds.decode([t for t in row if t != ds.pad_id]).split()
        out.append(words)
    return out


def test_listops_answers_match_independent_evaluator():
    cfg = dict(seed=3, max_depth=4, max_args=4, max_length=40, num_train=400, num_val=100)
    ds = load_dataset("listops", **cfg)
    assert ds.vocab_size == 17 and ds.seq_len == 41
    train = _listops_rows(ds, "train")
    val = _listops_rows(ds, "val")
    assert len(train) == 400 and len(val) == 100
    for words in train + val:
        assert words[-2] == "="
        expr = words[:-2]
        assert len(expr) <= cfg["max_length"]
        value, depth = _parse_listops(expr)
        assert 1 <= depth <= cfg["max_depth"]
        assert int(words[-1]) == value
    assert not {tuple(w) for w in val} & {tuple(w) for w in train}, "val repeats a training expression"


def test_listops_is_deterministic_and_seeded():
    a = load_dataset("listops", seed=1, num_train=50, num_val=10)
    b = load_dataset("listops", seed=1, num_train=50, num_val=10)
    c = load_dataset("listops", seed=2, num_train=50, num_val=10)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert not torch.equal(a.train, c.train)


def test_listops_batches_target_only_the_answer():
    ds = load_dataset("listops", seed=0, max_length=24, num_train=64, num_val=16)
    x, y = ds.get_batch("train", 8, 32, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (8, 32)
    eq = ds.encode("=")[0]
    for xi, yi in zip(x.tolist(), y.tolist(), strict=True):
        targets = [(t, v) for t, v in enumerate(yi) if v != IGNORE_INDEX]
        assert len(targets) == 1
        t, answer = targets[0]
        assert xi[t] == eq
        assert ds.decode([answer]).isdigit()
        assert _parse_listops(ds.decode(xi[:t]).split())[0] == int(ds.decode([answer]))
    with pytest.raises(DataError, match="block"):
        ds.get_batch("train", 8, 10)
    full = load_dataset("listops", seed=0, max_length=24, num_train=64, num_val=16, answer_only=False)
    _, y_all = full.get_batch("train", 8, 25, torch.Generator().manual_seed(0))
    assert ((y_all != IGNORE_INDEX).sum(1) > 1).all()


def test_listops_bad_config():
    with pytest.raises(DataError, match="max_args"):
        load_dataset("listops", max_args=1)
    with pytest.raises(DataError, match="distinct"):  # only 4 * 10 * 10 expressions exist
        load_dataset("listops", max_depth=1, max_args=2, num_train=10, num_val=2000)
    assert ListOpsConfig().max_length == 64


# ------------------------------------------------------------------------------------------ MQAR


def test_mqar_answers_are_recallable():
    n = 6
    ds = load_dataset("mqar", seed=5, vocab_size=256, seq_len=48, num_kv_pairs=n, num_train=200, num_val=50)
    assert ds.vocab_size == 256 and ds.seq_len == 48
    for split in ("train", "val"):
        rows = ds.split(split).view(-1, 49)
        x = rows[:, :-1]
        y = ds.rows[split][:, 1:].masked_fill(~ds.masks[split][:, 1:], IGNORE_INDEX)
        for xi, yi in zip(x.tolist(), y.tolist(), strict=True):
            keys, values = xi[0 : 2 * n : 2], xi[1 : 2 * n : 2]
            assert len(set(keys)) == n and all(1 <= k < 128 for k in keys)
            assert all(128 <= v < 256 for v in values)
            table = dict(zip(keys, values, strict=True))
            queried = []
            for t, target in enumerate(yi):
                if target != IGNORE_INDEX:
                    assert t >= 2 * n, "a target inside the key-value context"
                    assert table[xi[t]] == target
                    queried.append(xi[t])
            assert sorted(queried) == sorted(keys)  # every key queried exactly once


def test_mqar_deterministic_and_batches():
    kw = dict(seed=1, vocab_size=128, seq_len=32, num_kv_pairs=4, num_train=100, num_val=20)
    a, b = load_dataset("mqar", **kw), load_dataset("mqar", **kw)
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert not torch.equal(a.train, load_dataset("mqar", **{**kw, "seed": 2}).train)
    x, y = a.get_batch("val", 5, 40, torch.Generator().manual_seed(0))
    assert x.shape == (5, 40)
    assert ((y != IGNORE_INDEX).sum(1) == 4).all()
    assert (y[:, 32:] == IGNORE_INDEX).all()


def test_mqar_bad_config():
    with pytest.raises(DataError, match="seq_len"):
        load_dataset("mqar", seq_len=16, num_kv_pairs=8)
    with pytest.raises(DataError, match="vocab_size"):
        load_dataset("mqar", vocab_size=8, num_kv_pairs=8)


# ---------------------------------------------------------------------------------------- codecs


def test_codecs_round_trip_through_json():
    for codec, text in [
        (CharCodec("\n !abc"), "abc !\n"),
        (ByteCodec(), "ünïcode"),
        (WordCodec(["<pad>", "[MAX", "1", "]"]), "[MAX 1 1 ]"),
        (IntCodec(100), "1 2 99"),
    ]:
        again = codec_from_json(codec.to_json())
        assert again.vocab_size == codec.vocab_size
        assert again.decode(again.encode(text)) == text
    with pytest.raises(DataError, match="vocabulary"):
        CharCodec("abc").encode("abz")
    with pytest.raises(DataError):
        IntCodec(10).encode("3 12")


@pytest.mark.parametrize("name", ["listops", "mqar"])
def test_a_search_checks_a_tasks_block_with_the_length_its_examples_have(name: str) -> None:
    """`block_check` (a search's check before any trial) knows a task's example length without generating the
    examples: the block training accepts is the one it accepts, at the default options trials use."""
    from energydsl.training.data import block_check

    seq_len = load_dataset(name, num_train=8, num_val=4).seq_len  # the length depends on the config, not the count
    check = block_check(name)
    check(seq_len)
    with pytest.raises(DataError, match=f"{name} examples are {seq_len} tokens long but block_size is {seq_len - 1}"):
        check(seq_len - 1)


def test_a_symbolic_link_loop_or_a_dangling_link_is_named_as_such(tmp_path: Path) -> None:
    """Both read "text file not found" (an audit), where the file a user sees in `ls` is there: a link."""
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(DataError, match="text file is a loop of symbolic links: .*/a\n"):
        data_mod.load_dataset(f"chars:{tmp_path / 'a'}")
    with pytest.raises(DataError, match=f"text file is a symbolic link to nothing: .*dangling -> {tmp_path}/gone.txt"):
        data_mod.load_dataset(f"chars:{tmp_path / 'dangling'}")
