"""`ddtree-build` and `ddtree inspect` end to end: JSON output, the engine dir's layout, checksum
verification that names a corrupted file, and the build's errors (each names the flag or field)."""
import json
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from click.testing import CliRunner

from ddtree.builder import output_dir as od
from ddtree.cli import main
from ddtree.engine_dir import ENGINE_FORMAT, config_path, kernels_dir, manifest_path, rank_dir
from ddtree.plugins.compile import SOURCES

STAGES = {"check", "kernels", "weights", "config", "graphs", "manifest"}


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def build_args(ckpt, out, *extra):
    return ["build", "--model", ckpt[0], "--drafter", ckpt[1], "--tp", "2", "--arch", "sm_120", "--arch", "sm_90",
            "--out", out, *extra]


@pytest.fixture(scope="module")
def built(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "engines" / "tiny-tp2"
    r = invoke(*build_args(tiny_ckpt, out, "--budget", "8,16", "--json"))
    assert r.exit_code == 0, r.output
    return out, json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def test_build_json_and_layout(built):
    out, summary, stderr = built
    assert summary["engine"] == str(out) and summary["tp"] == 2 and summary["archs"] == ["sm_120", "sm_90"]
    assert set(summary["stages"]) == STAGES and summary["budgets"] == [8, 16]
    for stage in STAGES:
        assert f"{stage} done" in stderr
    config = json.loads(config_path(out).read_text())
    assert config["format"] == ENGINE_FORMAT and config["tp"] == 2 and config["block_size"] == 4
    assert config["budgets"] == [8, 16] and config["experts"] == "tp" and config["dtypes"]["dense"] == "bf16"
    for arch in ("sm_120", "sm_90"):
        cubins = sorted(p.name for p in kernels_dir(out, arch).iterdir())
        assert cubins == sorted(Path(source).stem + ".cubin" for source in SOURCES)      # every kernel source
        assert (kernels_dir(out, arch) / "moe.cubin").read_bytes()[:4] == b"\x7fELF"
    for r in (0, 1):
        assert sorted(p.name for p in rank_dir(out, r).iterdir()) == sorted(config["weight_files"])
    manifest = json.loads(manifest_path(out).read_text())
    files = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(manifest["files"]) == files and summary["files"] == len(files) + 1
    assert not list(out.parent.glob(".*building*"))                  # the staging folder is gone


def test_inspect_passes_then_names_a_flipped_byte(built, tmp_path):
    src, _, _ = built
    engine = tmp_path / "copy"
    shutil.copytree(src, engine)
    r = invoke("inspect", engine, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["ok"] and info["problems"] == [] and info["tp"] == 2
    assert [x["name"] for x in info["ranks"]] == ["rank0", "rank1"] and set(info["kernels"]) == {"sm_120", "sm_90"}
    assert "checksums: all" in r.stderr
    victim = rank_dir(engine, 1) / "layer-002.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    r = invoke("inspect", engine, "--json")
    assert r.exit_code == 1
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert not info["ok"] and len(info["problems"]) == 1
    assert info["problems"][0].startswith("rank1/layer-002.safetensors: sha256 mismatch")
    assert "rank1/layer-002.safetensors" in r.stderr
    (kernels_dir(engine, "sm_90") / "fill.cubin").unlink()
    (rank_dir(engine, 0) / "stray.bin").write_bytes(b"x")
    problems = json.loads(invoke("inspect", engine, "--json").stdout.strip().splitlines()[-1])["problems"]
    assert any(p.startswith("kernels/sm_90/fill.cubin: listed in manifest.json but missing") for p in problems)
    assert any(p.startswith("rank0/stray.bin: present but not listed") for p in problems)


def test_output_exists_needs_force(built, tiny_ckpt, tmp_path):
    out, _, _ = built
    r = invoke(*build_args(tiny_ckpt, out))
    assert r.exit_code != 0 and "already exists (use --force" in r.output
    not_engine = tmp_path / "precious"
    not_engine.mkdir()
    (not_engine / "notes.txt").write_text("keep me")
    r = invoke(*build_args(tiny_ckpt, not_engine, "--force"))
    assert r.exit_code != 0 and "is not a ddtree engine directory" in r.output
    assert (not_engine / "notes.txt").read_text() == "keep me"
    again = tmp_path / "again"
    shutil.copytree(out, again)
    r = invoke(*build_args(tiny_ckpt, again, "--force", "--tp", "4"))
    assert r.exit_code == 0, r.output
    assert json.loads(config_path(again).read_text())["tp"] == 4 and rank_dir(again, 3).is_dir()
    assert invoke("inspect", again).exit_code == 0


def test_build_errors(tiny_ckpt, tmp_path, monkeypatch):
    out = tmp_path / "e"
    cases = [
        (build_args(tiny_ckpt, out, "--tp", "8"), "num_attention_heads 4 is not divisible by 8"),
        (build_args(tiny_ckpt, out, "--arch", "sm_42"), "--arch sm_42: unknown architecture"),
        (build_args(tiny_ckpt, out, "--budget", "16,300"), "--budget: each budget must be in 1..255"),
        (["build", "--model", tiny_ckpt[0], "--tp", "2", "--arch", "sm_120", "--out", out], "Missing option '--drafter'"),
        (["build", "--model", tiny_ckpt[0], "--drafter", tmp_path, "--arch", "sm_120", "--out", out],
         f"--drafter {tmp_path}: {tmp_path}/config.json: config.json not found"),
    ]
    for args, message in cases:
        r = invoke(*args)
        assert r.exit_code != 0 and message in r.output, (args, r.output)
    assert not out.exists()

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(od.shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - 1000, 1000))
    r = invoke(*build_args(tiny_ckpt, out))
    assert r.exit_code != 0 and "not enough disk space" in r.output and "GB free" in r.output
    assert not out.exists()
    monkeypatch.undo()

    def no_nvrtc():
        raise ImportError("No module named 'cuda'")
    monkeypatch.setattr("ddtree.builder.output_dir.nvrtc_version", no_nvrtc)   # where require_nvrtc looks
    r = invoke(*build_args(tiny_ckpt, out))
    assert r.exit_code != 0 and "needs NVRTC from the 'cuda' extra" in r.output
    assert not out.exists() and not list(tmp_path.glob(".*building*"))


def test_parallel_expert_repack_writes_identical_files(built, tiny_ckpt, tmp_path):
    out, _, _ = built
    r = invoke(*build_args(tiny_ckpt, tmp_path / "jobs2", "--budget", "8,16", "--jobs", "2", "--experts", "tp"))
    assert r.exit_code == 0, r.output
    one = json.loads(manifest_path(out).read_text())["files"]
    two = json.loads(manifest_path(tmp_path / "jobs2").read_text())["files"]
    assert two == one                         # every file bit for bit, config.json included
    r = invoke(*build_args(tiny_ckpt, tmp_path / "jobs0", "--jobs", "0"))
    assert r.exit_code != 0 and "--jobs 0: must be >= 1" in r.output
