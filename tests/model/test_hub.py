"""A model named by a Hub id resolves offline from huggingface_hub's cache (model/hub.py). The cache is the
library's documented layout (blobs/<sha>, snapshots/<commit>/<file> symlinks, refs/main) holding the tiny model,
and the library itself must recognise it (scan_cache_dir) before the engine loads from it."""
import hashlib
import json
import os
import subprocess
import sys

import pytest

from ddtree.data import tiny_model_dirs
from ddtree.model.hub import ModelNotFoundError, resolve_model

huggingface_hub = pytest.importorskip("huggingface_hub")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_cached_repo(cache, repo_id: str, source_dir) -> None:
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in sorted(source_dir.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))


@pytest.fixture()
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    target, drafter = tiny_model_dirs()
    write_cached_repo(cache, "ddtree/tiny-target", target)
    write_cached_repo(cache, "ddtree/tiny-drafter", drafter)
    info = huggingface_hub.scan_cache_dir(cache)                 # the library reads our layout as its own
    assert not info.warnings
    assert {(r.repo_id, r.repo_type) for r in info.repos} == {("ddtree/tiny-target", "model"),
                                                               ("ddtree/tiny-drafter", "model")}
    assert {f.file_name for r in info.repos for rev in r.revisions for f in rev.files} >= {"config.json"}
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_engine_loads_a_hub_id_offline(hub_cache):
    """In a fresh interpreter (huggingface_hub reads HF_HUB_* at import): the same tokens as the embedded model."""
    code = ("from ddtree.runtime.engine import DDTreeEngine\n"
            "a = DDTreeEngine.load('ddtree/tiny-target', 'ddtree/tiny-drafter@main')\n"
            "b = DDTreeEngine.load()\n"
            "print(a.model_dir)\n"
            "assert a.generate('def', max_new_tokens=12).tokens == b.generate('def', max_new_tokens=12).tokens\n")
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(hub_cache / "models--ddtree--tiny-target" / "snapshots" / COMMIT)


def test_ddtree_run_takes_a_hub_id_offline(hub_cache):
    """`ddtree run --model owner/name --drafter owner/name@rev`: the cached snapshots, the embedded model's tokens."""
    run = [sys.executable, "-m", "ddtree", "run", "--max-new-tokens", "12", "--json", "def"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    hub = subprocess.run(run[:4] + ["--model", "ddtree/tiny-target", "--drafter", "ddtree/tiny-drafter@main"] + run[4:],
                         capture_output=True, text=True, timeout=300, env=env)
    local = subprocess.run(run, capture_output=True, text=True, timeout=300, env=env)
    assert hub.returncode == 0 and local.returncode == 0, hub.stderr + local.stderr
    assert json.loads(hub.stdout)["tokens"] == json.loads(local.stdout)["tokens"]
    missing = subprocess.run(run[:4] + ["--model", "/no/such/dir"] + run[4:], capture_output=True, text=True,
                             timeout=300, env=env)
    assert missing.returncode == 1 and "--model /no/such/dir: no such directory" in missing.stderr, missing.stderr


def test_missing_from_the_cache_offline_is_named(hub_cache):
    r = run_python("from ddtree.model.hub import resolve_model\nresolve_model('ddtree/not-cached')")
    assert r.returncode != 0
    assert "ModelNotFoundError: --model ddtree/not-cached: HF_HUB_OFFLINE is set and the Hub cache" in r.stderr


def test_local_dirs_and_bad_names(tmp_path):
    assert resolve_model(tmp_path) == tmp_path
    assert resolve_model(None) is None
    (tmp_path / "f").write_text("x")
    with pytest.raises(ModelNotFoundError, match="not a directory"):
        resolve_model(tmp_path / "f")
    with pytest.raises(ModelNotFoundError, match="no such directory, and not a Hugging Face Hub id"):
        resolve_model(str(tmp_path / "a" / "b" / "c"), "--drafter")
