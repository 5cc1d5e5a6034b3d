"""The pinned stdlib corpus: sha256 pins hold on this Python, mismatches are skipped by name."""
import json
import sys
import warnings

import pytest

from ddtree.training.corpus import CORPUS_JSON, HELDOUT_FILES, load_corpus, load_pins, make_prompts, sha256, stdlib_dir


def test_pins_load_here_with_a_heldout_split():
    pins = load_pins()
    corpus = load_corpus()
    if sys.version_info[:2] in ((3, 10), (3, 11), (3, 12)):
        assert corpus.skipped == []                 # pinned identical in CPython 3.10.13, 3.11.7, 3.12.1
    held = {p["path"] for p in pins if p["split"] == "heldout"}
    assert held == set(HELDOUT_FILES) and set(corpus.heldout_docs) <= held
    n_train = sum(p["bytes"] for p in pins if p["split"] == "train" and p["path"] not in corpus.skipped)
    assert len(corpus.train) == n_train + 2 * (len(pins) - len(held) - len(corpus.skipped))   # + BOS/EOS
    assert 0.05 < len(corpus.heldout) / (len(corpus.train) + len(corpus.heldout)) < 0.15


def test_a_changed_file_is_skipped_by_name(tmp_path):
    pins = load_pins()[:3] + [p for p in load_pins() if p["split"] == "heldout"][:1]
    for p in pins:
        dst = tmp_path / "lib" / p["path"]
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes((stdlib_dir() / p["path"]).read_bytes())
    changed = tmp_path / "lib" / pins[0]["path"]
    changed.write_bytes(changed.read_bytes() + b"\n# local patch\n")
    (tmp_path / "pins.json").write_text(json.dumps({"files": pins}))
    with pytest.warns(UserWarning, match=pins[0]["path"]):
        corpus = load_corpus(tmp_path / "pins.json", root=tmp_path / "lib")
    assert corpus.skipped == [pins[0]["path"]]
    assert sha256(changed.read_bytes()) != pins[0]["sha256"]


def test_prompts_end_on_a_def_line_within_the_budget():
    docs = {"m.py": b"".join(b"x = %d\n" % i for i in range(100)) + b"def f(a):\n    return a\n"}
    (p,) = make_prompts(docs, per_file=2, context=120)
    assert p["text"].endswith("def f(a):\n") and len(p["text"].encode()) <= 120
    assert p["line"] == 101 and docs["m.py"].decode().find(p["text"]) >= 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_pins(CORPUS_JSON)
