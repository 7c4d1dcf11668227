"""Every example passes `energy check`, and every seed family has its files."""

import glob
import json
from pathlib import Path

import pytest
from conftest import energy_in_process

import energydsl

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(glob.glob(str(ROOT / "examples/**/*.energy"), recursive=True))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(Path(p).relative_to(ROOT / "examples")))
def test_example_checks(path):
    spec = energydsl.load(path)
    derived = spec.derive()
    assert derived, f"{path} declares no energy"
    for d in derived:
        failed = [r for r in d.check() if not r.ok]
        assert not failed, failed
        assert d.equations("latex") and d.equations("mathml")


@pytest.mark.parametrize("family", ["intrinsic-optimizers", "cem", "nrgpt", "rmt", "hopfield"])
def test_every_family_has_examples(family):
    assert glob.glob(str(ROOT / "examples" / family / "*.energy")), family


def test_cli_json_reports_ok():
    path = str(ROOT / "examples/intrinsic-optimizers/mha.energy")
    res = energy_in_process("check", path, "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.splitlines()[0])
    assert report["ok"] is True and report["energies"][0]["checks"]


def test_multihead_latex_shows_softmax_before_and_after_untying():
    path = str(ROOT / "examples/intrinsic-optimizers/mha.energy")
    res = energy_in_process("derive", path, "--format", "latex")
    assert res.returncode == 0, res.stderr
    text = res.stdout.replace("\\mathrm{Wo}", "Wo")
    assert "softmax" in text and "untied update" in text and "Wo" in text
