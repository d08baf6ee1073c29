"""The GPU proving ground's pieces that need no GPU and no network: the bundle builder's logic
(scripts/gpu_bundle.py) and the report's (scripts/gpu_report.py). The whole script is rehearsed by
`make gpu-smoke` (scripts/gpu_checks.sh --cpu-smoke), which downloads."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from scripts import gpu_bundle, gpu_report

ROOT = Path(__file__).resolve().parents[2]


def test_bundled_versions_are_constraints_unless_an_entry_names_its_own() -> None:
    pinned = gpu_bundle.pins(ROOT / "constraints.txt")
    chosen = gpu_bundle.versions(gpu_bundle.BUNDLE, pinned)
    for item in gpu_bundle.BUNDLE:
        name = gpu_bundle.canonicalize_name(item.name)
        assert chosen[name] == (item.version or pinned[name]), item.name
        assert item.why, f"{item.name}: say why it is bundled"
    with pytest.raises(SystemExit, match="not pinned"):
        gpu_bundle.versions((gpu_bundle.Wanted("no-such-package", "why"),), pinned)


def test_nothing_the_gpu_machine_has_is_bundled_but_transformers_and_its_hub() -> None:
    bundled = {gpu_bundle.canonicalize_name(item.name) for item in gpu_bundle.BUNDLE}
    assert bundled & gpu_bundle.DEVICE_HAS == set()
    assert {"transformers", "huggingface-hub", "bitsandbytes", "xgrammar"} <= bundled
    assert not bundled & {"celery", "kombu", "redis", "boto3"}, "the proving ground imports none of them"


def test_unmet_names_missing_and_out_of_range_requirements_for_the_gpu_machine_only() -> None:
    requires = {
        "a": [
            "b>=2",  # bundled at 1.0: out of range
            "torch>=2.4",  # on the machine
            "missing-thing",  # nowhere
            'tomli>=1; python_version < "3.11"',  # not on Python 3.12
            'pywin32; sys_platform == "win32"',  # not on Linux
            'rich; extra == "cli"',  # an extra nobody asked for
        ],
        "b": ["c==2.0"],
    }
    problems = gpu_bundle.unmet(requires, {"a": "1", "b": "1.0", "c": "2.0"}, frozenset({"torch"}))
    assert problems == [
        "a needs b>=2; the bundle has b 1.0",
        "a needs missing-thing: neither bundled nor on the GPU machine",
    ]


def _fake_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
        archive.writestr("pkg-1.0.dist-info/RECORD", "stale\n")
    return path


def test_cut_keeps_the_named_libraries_and_rewrites_the_record(tmp_path: Path) -> None:
    members = {
        "pkg/__init__.py": b"x = 1\n",
        "pkg/libpkg_cpu.so": b"cpu",
        "pkg/libpkg_cuda130.so": b"cuda 13.0",
        "pkg/libpkg_cuda118.so": b"cuda 11.8" * 100,
        "pkg/libpkg_rocm64.so": b"rocm",
        "pkg-1.0.dist-info/METADATA": b"Name: pkg\nVersion: 1.0\n",
    }
    source = _fake_wheel(tmp_path / "pkg-1.0-py3-none-any.whl", members)
    out = tmp_path / "out.whl"
    dropped = gpu_bundle.cut(source, ("pkg/libpkg_cpu.so", "pkg/libpkg_cuda130.so"), out)
    assert sorted(dropped) == ["pkg/libpkg_cuda118.so", "pkg/libpkg_rocm64.so"]
    with zipfile.ZipFile(out) as archive:
        names = set(archive.namelist())
        record = archive.read("pkg-1.0.dist-info/RECORD").decode().splitlines()
        contents = {name: archive.read(name) for name in names}
    assert names == {n for n in members if n not in dropped} | {"pkg-1.0.dist-info/RECORD"}
    assert record[-1] == "pkg-1.0.dist-info/RECORD,,"
    for line in record[:-1]:
        name, digest, size = line.split(",")
        expected = base64.urlsafe_b64encode(hashlib.sha256(contents[name]).digest()).rstrip(b"=").decode()
        assert (digest, int(size)) == (f"sha256={expected}", len(contents[name])), name
    assert len(record) - 1 == len(names) - 1
    with pytest.raises(SystemExit, match="not in the wheel"):
        gpu_bundle.cut(source, ("pkg/libpkg_cuda999.so",), tmp_path / "again.whl")


def test_tree_bytes_counts_what_travels_and_not_what_git_ignores(tmp_path: Path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/gpu-bundle/\n")
    (tmp_path / "tracked.py").write_text("a" * 100)
    (tmp_path / "untracked.py").write_text("b" * 10)
    (tmp_path / "gpu-bundle").mkdir()
    (tmp_path / "gpu-bundle" / "big.whl").write_bytes(b"c" * 5000)
    subprocess.run(["git", "-C", str(tmp_path), "add", "tracked.py"], check=True)
    assert gpu_bundle.tree_bytes(tmp_path) == 100 + 10 + len("/gpu-bundle/\n")


def test_the_report_names_each_step_and_survives_partial_figures(tmp_path: Path) -> None:
    (tmp_path / "steps.tsv").write_text(
        "env\t0\t12\t40\t\nmodel\t124\t150\t150\t\nstep-cost\t-\t0\t0\tnot in this tree\nengine\t1\t3\t90\t\n"
    )
    (tmp_path / "model.json").write_text('{"modes": [{"mode": "bf16", "batches": [{"batch": 1}]}]}')
    (tmp_path / "engine.json").write_text('{"runs": [')  # cut short mid-write
    prefill = {
        "calls": [{"prefix": 300, "rows": 16, "tail": 24, "each": 80.0, "together": 20.0}],
        "prefill": [
            {"positions": 2400, "whole": 100.0, "hit": 9.0, "chunks_512": 125.0, "chunks_2048": 104.0}
        ],
    }
    (tmp_path / "prefill.json").write_text(json.dumps(prefill))
    report = {"mode": "gpu", "date": "today", "steps": gpu_report.steps(tmp_path), "tests_gpu": None}
    report.update({name: gpu_report._load(tmp_path, name) for name in gpu_report.PARTS})
    assert [s["status"] for s in report["steps"]] == ["ok", "timed out", "skipped", "failed"]
    text = gpu_report.summary(report)
    assert "model: partial figures" in text
    assert "not in this tree" in text
    assert (
        "16 rows x 24 after a 300-position photo: one call a row 80.00, one call for all 20.00 (0.25)" in text
    )
    assert "2400 positions: whole 100.00, chunks of 512 125.00 (1.25), chunks of 2048 104.00 (1.04)" in text
    assert report["engine"] == {"unreadable": report["engine"]["unreadable"]}


def test_the_report_reads_pytest_junit_failures_and_skip_reasons(tmp_path: Path) -> None:
    (tmp_path / "tests_gpu.xml").write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="2">'
        '<testcase name="a"/><testcase name="b"><failure message="boom"/></testcase>'
        '<testcase name="c"><skipped message="needs CUDA"/></testcase>'
        '<testcase name="d"><skipped message="needs CUDA"/></testcase></testsuite></testsuites>'
    )
    outcome = gpu_report.tests(tmp_path)
    assert outcome is not None
    assert (outcome["tests"], outcome["failures"], outcome["skipped"]) == (4, 1, 2)
    assert outcome["not_passed"] == ["b: failure: boom"]
    assert outcome["skipped_because"] == {"needs CUDA": 2}
