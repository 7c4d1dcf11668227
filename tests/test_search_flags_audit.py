"""The search flags an audit found unchecked: `energy search` / `energy report` refuse them with exit status 2 and a
message naming the flag and what is allowed, before a storage is opened, a trial runs or a backend starts.

The CLI runs in this process (`cli.main()`, as the `energy` script does), on the toy space (no DSL, no torch); every
storage is a real Optuna journal or SQLite file in tmp_path, and no test starts Ray.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import optuna
import pytest
from conftest import energy_in_process

from energydsl.errors import UserError
from energydsl.search import SpaceRef, load_study, open_storage, run_search

ROOT = Path(__file__).resolve().parents[1]


def toy(tmp_path: Path) -> SpaceRef:
    return SpaceRef("energydsl.search.toy:make_space", {"calls": str(tmp_path / "calls.txt"), "sleep": "0",
                                                        "mixers": "ssm,attn"})


def energy(*args: str) -> tuple[int, str]:
    """`energy ARGS` in this process: (exit status, stderr)."""
    result = energy_in_process(*args)
    return result.returncode, result.stderr


def refused(result: tuple[int, str], *words: str) -> None:
    code, err = result
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in err and "internal error" not in err, err[-2000:]
    for w in words:
        assert w in err, err[-2000:]


def toy_search(tmp_path: Path, *flags: str) -> list[str]:
    return ["search", "toy", "--set", f"calls={tmp_path / 'calls.txt'}", "--set", "sleep=0", "--trials", "1",
            "--json", *flags]


# ----------------------------------------------------------------------------- 1. storage URLs


def test_a_storage_url_without_its_slashes_is_refused_with_the_right_form(tmp_path, monkeypatch, capsys) -> None:
    """`sqlite:/x.db` used to make a folder `sqlite:` holding a journal `x.db`, and search there."""
    monkeypatch.chdir(tmp_path)
    refused(energy(*toy_search(tmp_path, "--storage", "sqlite:/x.db")),
            "error: storage 'sqlite:/x.db'", "without the `//`", "hint:", "sqlite:///x.db", "sqlite:////x.db")
    refused(energy(*toy_search(tmp_path, "--storage", "postgresql:host/db")),
            "postgresql://USER:PASSWORD@HOST/DATABASE")
    refused(energy("report", "sqlite:/x.db"), "sqlite:///x.db")
    refused(energy("report", "Q", "--storage", "sqlite:/x.db"), "sqlite:///x.db")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no `sqlite:` folder, no trial, no runs/
    for spec in ("sqlite:x.db", "mysql+pymysql:/db", "anything:/x.journal"):
        with pytest.raises(UserError, match="without the `//`"):
            open_storage(spec)


def test_an_in_memory_sqlite_storage_is_refused(tmp_path, monkeypatch, capsys) -> None:
    """Every connection sees an empty in-memory database: the search used to end in an internal error (exit 70,
    KeyError 'Record does not exist') after its trials ran."""
    monkeypatch.chdir(tmp_path)
    for url in ("sqlite://", "sqlite:///:memory:", "sqlite+pysqlite://"):
        refused(energy(*toy_search(tmp_path, "--storage", url)), "in-memory SQLite", url)
    refused(energy("report", "Q", "--storage", "sqlite://"), "in-memory SQLite")
    assert not (tmp_path / "calls.txt").exists() and not (tmp_path / "runs").exists()


def test_the_legal_storage_forms_still_work(tmp_path, monkeypatch) -> None:
    """SQLite URLs (relative, absolute, with a driver), server URLs, journal paths (a colon in a name, a Windows
    drive), and a journal whose path starts like a URL, written as the hint says (./)."""
    from energydsl.search.storage import check_storage_given

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for spec in ("sqlite:///rel.db", "sqlite:////abs/s.db", "sqlite+pysqlite:///s.db", "sqlite:///s.db?timeout=5",
                 "postgresql://user@host/db", "postgresql+psycopg2://u:p@h:5432/db", "mysql://u@h/db",
                 "runs/a:b/optuna.journal", "study:v2.journal", "C:/runs/s.journal", "./sqlite:/x.db"):
        check_storage_given(spec)
    specs = {"sqlite:///rel.db": work / "rel.db", "./sqlite:/x.db": work / "sqlite:" / "x.db"}
    for spec, file in specs.items():
        s = run_search(toy(tmp_path), storage=spec, study_name="t", trials=1, progress=False, json=True)
        assert s["finished"] == 1 and file.is_file(), spec
        assert len(load_study(spec, "t").trials) == 1


# ----------------------------------------------------------------------------- 2. numeric and other flags


@pytest.mark.parametrize("flags, words", [
    (["--gpus-per-trial", "-1"], ["--gpus-per-trial must be a number at least 0, not -1", "gpus_per_trial >= 0"]),
    (["--gpus-per-trial", "nan"], ["--gpus-per-trial must be a number at least 0, not nan"]),
    (["--gpus-per-trial", "inf"], ["--gpus-per-trial must be a number at least 0, not inf"]),
    (["--cpus-per-trial", "0"], ["--cpus-per-trial must be a number above 0, not 0", "cpus_per_trial > 0"]),
    (["--cpus-per-trial", "-2"], ["--cpus-per-trial must be a number above 0, not -2"]),
    (["--cpus-per-trial", "nan"], ["--cpus-per-trial must be a number above 0, not nan"]),
    # Ray's "precision ... cannot go beyond 0.0001" came from inside tuner.fit(): exit 70
    (["--backend", "ray", "--cpus-per-trial", "0.00001"], ["--cpus-per-trial 1e-05: Ray counts resources in steps"]),
    (["--backend", "ray", "--gpus-per-trial", "0.33333"], ["--gpus-per-trial 0.33333: Ray counts resources in steps"]),
    (["--study", ""], ["--study is empty"]),
    (["--study", "  "], ["--study is empty"]),
    (["--address", "auto"], ["--address 'auto' names a Ray cluster", "local backend", "hint: add --backend ray"]),
    (["--workers", "0"], ["--workers must be at least 1, not 0"]),
    (["--trials", "0"], ["--trials must be at least 1, not 0"]),
    (["--trials", "-3"], ["--trials must be at least 1, not -3"]),
    (["--timeout", "nan"], ["--timeout", "positive number of seconds"]),
    (["--seed", "-1"], ["--seed", "between 0 and 2**32 - 1"]),
    (["--backend", "ray", "--device", "cuda"], ["--device cuda on the ray backend", "--gpus-per-trial"]),
])
def test_out_of_range_search_flags_exit_2_naming_the_flag(tmp_path, monkeypatch, capsys, flags, words) -> None:
    journal = tmp_path / "s.journal"
    monkeypatch.chdir(tmp_path)
    refused(energy(*toy_search(tmp_path, "--storage", str(journal), *flags)), *words)
    assert not journal.exists() and not (tmp_path / "calls.txt").exists()  # no study opened, no trial ran


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_a_missing_gpu_is_named_as_the_flag(tmp_path, monkeypatch, capsys) -> None:
    journal = tmp_path / "s.journal"
    monkeypatch.chdir(tmp_path)
    space = str(Path(__file__).resolve().parents[1] / "search/quickstart.energy")
    refused(energy("search", space, "--storage", str(journal), "--device", "cuda:0"),
            "device 'cuda:0' requested but CUDA is not available", "hint: use --device cpu")
    assert not journal.exists()


def test_a_device_index_past_the_machines_gpus_is_refused(monkeypatch) -> None:
    """`cuda:7` on a machine with two GPUs reached torch as a CUDA error mid-run; `cuda:0` without CUDA said
    `device 'cuda' requested`."""
    import torch

    from energydsl.errors import UserError
    from energydsl.training.config import device_of

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UserError) as err:
        device_of("cuda:7", "--device")
    assert err.value.message == "device 'cuda:7' requested but this machine has 2 CUDA devices"
    assert err.value.hint == "use cuda:0 to cuda:1, or cuda"


def test_an_empty_address_is_refused_before_ray_starts(tmp_path, monkeypatch, capsys) -> None:
    """`--address ''` used to start a local Ray runtime, as no --address does."""
    journal = tmp_path / "s.journal"
    monkeypatch.chdir(tmp_path)
    refused(energy(*toy_search(tmp_path, "--storage", str(journal), "--backend", "ray",
                                                    "--address", "")), "--address is empty", "HEAD_IP:6379")
    assert not journal.exists() and not (tmp_path / "calls.txt").exists()


def test_the_api_refuses_what_the_flags_refuse(tmp_path) -> None:
    bad = [dict(gpus_per_trial=-1.0), dict(gpus_per_trial=float("nan")), dict(cpus_per_trial=0.0),
           dict(study_name=""), dict(address="auto"), dict(trials=0)]
    for kwargs in bad:
        with pytest.raises(UserError):
            run_search(toy(tmp_path), storage=str(tmp_path / "s.journal"), progress=False, json=True,
                       **{"trials": 1, **kwargs})
    assert not (tmp_path / "s.journal").exists() and not (tmp_path / "calls.txt").exists()


# ----------------------------------------------------------------------------- 3. a storage without studies


def test_report_on_a_storage_without_studies_says_so_and_where(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.journal").write_text("")
    db = tmp_path / "new.db"
    optuna.storages.RDBStorage(f"sqlite:///{db}")  # a database with its tables and no study
    for args in (["report", "empty.journal"], ["report", f"sqlite:///{db}"],
                 ["report", "q", "--storage", "empty.journal", "--study", "q"]):
        code, err = energy(*args)
        refused((code, err), "holds no studies")
        assert "pick one with --study" not in err and "studies there: []" not in err, err
    refused(energy("report", "empty.journal"), str(tmp_path / "empty.journal"))
    refused(energy("report", f"sqlite:///{db}"), f"sqlite:///{db}")
    refused(energy("report", "x", "--storage", "empty.journal", "--study", ""), "--study is empty")
    assert not (tmp_path / "report.html").exists()


# ----------------------------------------------------------------------------- 4. --backend


def test_an_unknown_backend_names_the_flag_and_the_cli_values(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code, err = energy(*toy_search(tmp_path, "--backend", "bogus"))
    refused((code, err), "unknown --backend 'bogus'; choose one of local, ray")
    assert "run_search" not in err and "backend=" not in err
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- 5. --workers past this machine


def test_more_workers_than_this_machine_runs_are_refused_before_anything_starts(tmp_path, monkeypatch,
                                                                                  capsys) -> None:
    """`--workers 100000` used to start 100000 worker processes (or declare as many CPUs to a local Ray runtime)."""
    import energydsl.search

    def went_on(*args: object, **kwargs: object) -> None:  # a regression fails here, before any process starts
        raise AssertionError("the search went on to open its study")

    monkeypatch.setattr(energydsl.search, "open_study", went_on)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    journal = tmp_path / "s.journal"
    monkeypatch.chdir(tmp_path)
    for flags, cluster in ((["--workers", "100000"], "--backend ray --address HEAD_IP:6379"),
                           (["--workers", "9"], "--backend ray --address HEAD_IP:6379"),
                           (["--backend", "ray", "--workers", "9"], "(--address HEAD_IP:6379)")):
        refused(energy(*toy_search(tmp_path, "--storage", str(journal), *flags)),
                f"error: --workers {flags[-1]} is more than this machine runs at once: at most 8 (4 per CPU, 2 CPUs "
                "here)", "hint: these trials all run on this machine: give --workers 8 or fewer", cluster)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no study opened, no trial ran, no runs/


def test_the_workers_bound_counts_only_trials_run_on_this_machine(monkeypatch) -> None:
    """At the bound is fine; more workers than trials too (the extra ones exit); a Ray cluster is not this machine."""
    from energydsl.search import check_options

    monkeypatch.setattr("os.cpu_count", lambda: 2)
    ok = dict(backend="local", trials=1, timeout=None, storage=None, study_name=None, pruner="asha", device="cpu",
              address=None, gpus_per_trial=None, cpus_per_trial=None, seed=None)
    check_options(**{**ok, "workers": 8})
    check_options(**{**ok, "backend": "ray", "address": "auto", "workers": 100000})
    with pytest.raises(UserError, match="at most 8"):
        check_options(**{**ok, "backend": "ray", "workers": 9})


# ----------------------------------------------------------------------------- 6. Ray's resource flags on local


@pytest.mark.parametrize("flags", [["--gpus-per-trial", "0.5"], ["--cpus-per-trial", "2"],
                                   ["--gpus-per-trial", "0"], ["--cpus-per-trial", "1"],  # Ray's defaults, given
                                   ["--backend", "local", "--cpus-per-trial", "4"]])
def test_ray_resource_flags_without_backend_ray_are_refused(tmp_path, monkeypatch, capsys, flags) -> None:
    """The local backend used to ignore --gpus-per-trial / --cpus-per-trial without a word."""
    journal = tmp_path / "s.journal"
    monkeypatch.chdir(tmp_path)
    flag, value = flags[-2:]
    refused(energy(*toy_search(tmp_path, "--storage", str(journal), *flags)),
            f"error: {flag} {value} reserves resources for each Ray trial, and the local backend does not use it",
            "hint: add --backend ray", f"or leave {flag} out")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(UserError, match="the local backend does not use it"):
        run_search(toy(tmp_path), storage=str(journal), trials=1, progress=False, json=True,
                   **{flag.removeprefix("--").replace("-", "_"): float(value)})
    assert not journal.exists()


def test_without_the_resource_flags_local_runs_and_ray_reserves_its_defaults(tmp_path, monkeypatch, capsys) -> None:
    """Not giving them is not giving them: the local backend runs, and a Ray trial still reserves 0 GPUs, 1 CPU."""
    monkeypatch.chdir(tmp_path)
    code, err = energy(*toy_search(tmp_path, "--storage", "s.journal"))
    assert code == 0, err[-2000:]
    assert len(load_study("s.journal", "toy").trials) == 1
    pytest.importorskip("ray")
    import energydsl.search.ray_backend as ray_backend

    reserved: list[tuple[float, float]] = []
    monkeypatch.setattr(ray_backend, "run_ray", lambda *a, **kw: reserved.append(
        (kw["gpus_per_trial"], kw["cpus_per_trial"])) or {})  # no Ray started: what it would have been given
    monkeypatch.setattr(ray_backend, "check_local_gpus", lambda gpus: None)  # as on a machine with a GPU
    for flags in ([], ["--gpus-per-trial", "0.5", "--cpus-per-trial", "2"]):
        code, err = energy(*toy_search(tmp_path, "--storage", "r.journal", "--backend", "ray",
                                                            *flags))
        assert code == 0, err[-2000:]
    assert reserved == [(0.0, 1.0), (0.5, 2.0)]


# ----------------------------------------------------------------------------- 7. a report of a missing study


def test_a_report_of_a_study_the_storage_does_not_hold_leaves_no_trace(tmp_path, monkeypatch, capsys) -> None:
    """`energy report NAME --storage URL` used to create runs/NAME/ (or -o's, --export's folder) before finding
    that the storage holds no study NAME."""
    db = tmp_path / "store" / "s.db"
    db.parent.mkdir()
    run_search(toy(tmp_path), storage=f"sqlite:///{db}", study_name="t", trials=1, progress=False, json=True)
    (tmp_path / "store" / "empty.journal").write_text("")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    before = sorted(tmp_path.rglob("*"))
    for args, words in (
        (["report", "Nope", "--storage", f"sqlite+pysqlite:///{db}"], ["studies there: ['t']"]),  # no local file
        (["report", "Nope", "--storage", f"sqlite:///{db}", "-o", "out/new/r.html", "--export", "ex/b.energy"],
         ["studies there: ['t']"]),
        (["report", "Nope", "--storage", str(db.parent / "empty.journal"), "-o", "out/new/r.html"],
         ["holds no studies"])):
        refused(energy(*args), "error: no study 'Nope' in", "hint:", *words)
        assert sorted(tmp_path.rglob("*")) == before, args  # no runs/Nope, out/new or ex folder


def test_a_report_reads_the_storage_once(tmp_path, monkeypatch, capsys) -> None:
    """The HTML report, the leaderboard and --export share one loaded study (a large journal is replayed once)."""
    import energydsl.search as search_pkg
    import energydsl.search.report as report_mod

    journal = tmp_path / "s.journal"
    run_search(toy(tmp_path), storage=str(journal), study_name="t", trials=1, progress=False, json=True)
    loads = []
    for module in (search_pkg, report_mod):
        real = module.load_study
        monkeypatch.setattr(module, "load_study", lambda *a, real=real, **k: loads.append(a) or real(*a, **k))
    code, err = energy("report", "t", "--storage", str(journal), "-o",
                       str(tmp_path / "r.html"), "--export", str(tmp_path / "best.energy"))
    assert code == 0, err
    assert (tmp_path / "r.html").exists() and (tmp_path / "best.energy").exists()
    assert len(loads) == 1, loads


@pytest.mark.parametrize("option, value, says", [
    ("trials", 2.5, "trials must be a whole number, not 2.5"),  # ran 2 trials
    ("trials", True, "trials must be a whole number, not True"),  # ran 1
    ("workers", "2", "workers must be a whole number, not '2'"),  # '<' not supported between 'str' and 'int'
    ("workers", 1.5, "workers must be a whole number, not 1.5"),  # failed in range() after the study opened
    ("seed", 2.5, "seed must be a whole number, not 2.5"),  # failed inside numpy
    ("timeout", "5", "timeout must be a number, not '5'"),
    ("storage", 5, "storage must be a string, not 5"),  # 'int' object has no attribute 'strip'
    ("study_name", 3, "study_name must be a string, not 3"),
])
def test_run_search_refuses_an_option_of_the_wrong_kind_by_name(tmp_path, option, value, says) -> None:
    from energydsl.search import run_search

    with pytest.raises(UserError) as e:
        run_search("toy", progress=False, **{"storage": str(tmp_path / "s.journal"), option: value})
    assert e.value.message == f"run_search's {says} ({type(value).__name__})"
    assert not (tmp_path / "s.journal").exists()


def test_studies_sharing_a_storage_keep_their_own_report_and_best(tmp_path, monkeypatch, capsys) -> None:
    """Two studies in one storage wrote the same report.html and best.energy: the second overwrote the first's."""
    journal = tmp_path / "zoo.journal"
    monkeypatch.chdir(tmp_path)
    for study in ("A", "B"):
        code, err = energy(*toy_search(tmp_path, "--storage", str(journal), "--study", study,
                                                            "--trials", "4", "--seed", "3", "--pruner", "none"))
        assert code == 0, err
    assert (tmp_path / "report.html").exists() and (tmp_path / "best.energy").exists()  # A's, alone then
    assert (tmp_path / "report-B.html").exists() and (tmp_path / "best-B.energy").exists()
    a_best = (tmp_path / "best.energy").read_text()
    code, err = energy("report", str(journal), "--study", "A")
    assert code == 0 and (tmp_path / "report-A.html").exists(), err
    assert (tmp_path / "best.energy").read_text() == a_best


def test_studies_whose_names_read_alike_as_files_keep_their_own_outputs(tmp_path) -> None:
    """Studies `x y` and `x_y` in one storage shared report-x_y.html, best-x_y.energy and the lock file."""
    import optuna

    from energydsl.search.storage import lock_path, study_outputs

    journal = str(tmp_path / "zoo.journal")
    for name in ("x y", "x_y", "x/y"):
        optuna.create_study(study_name=name, storage=open_storage(journal))
    outputs = {name: study_outputs(journal, name) for name in ("x y", "x_y", "x/y")}
    files = [f.name for pair in outputs.values() for f in pair] + [lock_path(journal, n).name for n in outputs]
    assert len(set(files)) == len(files), files
    assert outputs["x_y"] == (tmp_path / "report-x_y.html", tmp_path / "best-x_y.energy")  # a plain name's as before


def test_report_json_lists_every_trial_as_strict_json(tmp_path, monkeypatch, capsys) -> None:
    """No machine-readable dump of a study's trials existed: `--json` of a search gives its summary only."""
    from conftest import strict_json

    journal = tmp_path / "s.journal"
    monkeypatch.chdir(tmp_path)
    code, err = energy(*toy_search(tmp_path, "--storage", str(journal), "--trials", "4",
                                                        "--seed", "3", "--pruner", "none"))
    assert code == 0, err
    monkeypatch.setattr(sys, "argv", ["energy", "report", str(journal), "--json"])
    from energydsl import cli

    with contextlib.suppress(SystemExit):
        cli.main()
    out = capsys.readouterr().out
    dump = strict_json(out)
    assert [t["number"] for t in dump["trials"]] == [0, 1, 2, 3]
    assert {"state", "kind", "params", "values", "metrics", "reason", "duplicate_of"} <= set(dump["trials"][0])
    done = [t for t in dump["trials"] if t["state"] == "COMPLETE"]
    assert done and all(t["values"]["val_loss"] == t["metrics"]["val_loss"] for t in done)


def test_more_cpus_per_trial_than_this_machine_has_is_refused_for_a_local_runtime(tmp_path, monkeypatch,
                                                                                  capsys) -> None:
    """`--backend ray --cpus-per-trial 64` on a 2-CPU machine ran each trial with 64 threads."""
    pytest.importorskip("ray")
    journal = tmp_path / "s.journal"
    monkeypatch.chdir(tmp_path)
    many = str((os.cpu_count() or 1) + 1)
    refused(energy(*toy_search(tmp_path, "--storage", str(journal), "--backend", "ray",
                                                    "--cpus-per-trial", many)),
            f"--cpus-per-trial {many}: this machine has", "a local Ray runtime")
    assert not journal.exists() and not (tmp_path / "calls.txt").exists()


@pytest.mark.parametrize("sampler, package", [("cmaes", "cmaes"), ("qmc", "scipy")])
def test_a_sampler_whose_package_is_missing_names_the_extra(tmp_path, monkeypatch, capsys, sampler, package) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else find_spec(name, *a))
    monkeypatch.chdir(tmp_path)
    refused(energy(*toy_search(tmp_path, "--storage", str(tmp_path / "s.journal"),
                                                    "--sampler", sampler)),
            f"needs {'the `cmaes` package' if package == 'cmaes' else 'scipy'}", ".[samplers]")


def test_report_refuses_two_different_study_names(tmp_path, monkeypatch, capsys) -> None:
    """`energy report toy --storage S --study Q` reported Q and dropped `toy` without a word."""
    journal = tmp_path / "s.journal"
    monkeypatch.chdir(tmp_path)
    code, err = energy(*toy_search(tmp_path, "--storage", str(journal), "--study", "Q"))
    assert code == 0, err
    refused(energy("report", "toy", "--storage", str(journal), "--study", "Q"),
            "STUDY 'toy' and --study 'Q' name two studies")
    code, err = energy("report", "Q", "--storage", str(journal), "--study", "Q")
    assert code == 0, err


def test_an_empty_space_is_named_as_empty(monkeypatch, capsys) -> None:
    """`energy search ""` said ` is a directory, not a .energy file`."""
    refused(energy("search", "", "--json"), "SPACE is empty", "quickstart.energy")


def test_a_database_storage_error_is_the_databases_not_sqlalchemys(tmp_path, monkeypatch, capsys) -> None:
    """A sqlite URL to a text file printed SQLAlchemy's SQL statement and its web link; a URL whose driver is
    missing said `Please install appropriate one`, naming none."""
    (tmp_path / "notes.txt").write_text("not a database\n")
    code, err = energy(*toy_search(tmp_path, "--storage", f"sqlite:///{tmp_path}/notes.txt"))
    refused((code, err), "file is not a database")
    assert "sqlalche.me" not in err and "[SQL:" not in err, err
    import importlib.util

    if importlib.util.find_spec("MySQLdb") is None:
        refused(energy(*toy_search(tmp_path, "--storage", "mysql://nohost/db")),
                "the Python module `MySQLdb`, is not installed", "pip install mysqlclient")


def test_a_study_that_already_holds_its_trials_says_none_ran(tmp_path, monkeypatch, capsys) -> None:
    """`--trials 1` on a study of 2 finished trials showed `2/1 trials` and nothing said why none ran."""
    journal = str(tmp_path / "s.journal")
    run_search(toy(tmp_path), storage=journal, study_name="t", trials=2, progress=False, json=True)
    summary = run_search(toy(tmp_path), storage=journal, study_name="t", trials=1, progress=False, json=True)
    assert summary["finished"] == 2 and any("already holds 2 finished trials" in n and "--trials 3" in n
                                            for n in summary["notes"]), summary
    fresh = run_search(toy(tmp_path), storage=journal, study_name="t", trials=3, progress=False, json=True)
    assert fresh["finished"] == 3 and not any("already holds" in n for n in fresh["notes"]), fresh


def test_a_second_study_in_a_storage_says_the_first_ones_report_is_older(tmp_path, monkeypatch, capsys) -> None:
    """With a second study in one database the outputs become report-STUDY.html; report.html and best.energy of
    the first run stayed beside them, saying nothing of being older. Paths in the summary are absolute, as a
    journal's were (a sqlite URL's were relative to the working directory)."""
    monkeypatch.chdir(tmp_path)
    url = "sqlite:///sq/s.db"
    code, err = energy(*toy_search(tmp_path, "--storage", url, "--study", "A"))
    assert code == 0 and (tmp_path / "sq/report.html").exists() and "older" not in err, err
    code, err = energy(*toy_search(tmp_path, "--storage", url, "--study", "B"))
    assert code == 0 and (tmp_path / "sq/report-B.html").exists(), err
    assert f"{tmp_path / 'sq/report.html'} and best.energy beside it are older" in err, err


def test_brackets_in_a_study_name_or_a_path_are_printed_as_written(tmp_path, monkeypatch, capsys) -> None:
    """rich read a study named `run[/]x` as markup: the search ran its trials, then exited 70 before writing its
    report and best candidate; `energy report` exited 70 too, before `--export`. A check of `m[1].energy`
    read its name as a glob and found no file."""
    monkeypatch.chdir(tmp_path)
    flags = [a for a in toy_search(tmp_path, "--study", "run[/]x[red]", "--storage", "s.journal", "--set", "mixers=ssm")
             if a != "--json"]
    result = energy_in_process(*flags)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "run[/]x[red]: top 1 trials" in result.stderr, result.stderr
    assert (tmp_path / "report.html").exists() and (tmp_path / "best.energy").exists()
    result = energy_in_process("report", "s.journal", "-o", "r[/].html", "--export", "b[/].energy")
    assert result.returncode == 0 and "run[/]x[red]: top 1 trials" in result.stdout, result.stderr[-2000:]
    assert (tmp_path / "r[/].html").exists() and (tmp_path / "b[/].energy").exists()
    (tmp_path / "m[1].energy").write_text((ROOT / "examples/intrinsic-optimizers/mha.energy").read_text())
    result = energy_in_process("check", "m[1].energy")
    assert result.returncode == 0 and "m[1].energy: ok" in result.stdout, result.stdout + result.stderr


def test_a_report_on_a_database_without_optuna_tables_leaves_it_untouched(tmp_path, monkeypatch, capsys) -> None:
    """`energy report sqlite:///other.db` said "holds no studies", after Optuna had created its dozen tables in
    another program's database (an empty file grew to 112 kB)."""
    import sqlite3

    monkeypatch.chdir(tmp_path)
    with contextlib.closing(sqlite3.connect(tmp_path / "other.db")) as db:
        db.execute("CREATE TABLE mydata (x INTEGER)")
        db.commit()
    before = (tmp_path / "other.db").read_bytes()
    (tmp_path / "empty.db").write_bytes(b"")
    refused(energy("report", "sqlite:///other.db"), "holds no studies: it has no Optuna tables", "other.db")
    refused(energy("report", "q", "--storage", "sqlite:///empty.db", "--study", "q"), "has no Optuna tables")
    with pytest.raises(UserError, match="has no Optuna tables"):
        load_study("sqlite:///other.db", "q")
    assert (tmp_path / "other.db").read_bytes() == before and (tmp_path / "empty.db").read_bytes() == b""
    refused(energy("report", "q", "--storage", "sqlite:///missing.db", "--study", "q"), "no study storage")
    assert not (tmp_path / "missing.db").exists()
    (tmp_path / "folder").mkdir()  # said "no file" of a directory that is there
    refused(energy("report", "sqlite:///folder"), "names a directory", "not an SQLite database file")
    code, _ = energy(*toy_search(tmp_path, "--storage", "sqlite:///new.db"))  # a search still creates its database
    assert code == 0 and len(load_study("sqlite:///new.db", "toy").trials) == 1


def test_report_refuses_empty_outputs_and_a_loop_of_links(tmp_path, monkeypatch, capsys) -> None:
    """`energy report S -o "" --export ""` wrote the default report and exported nothing, exit 0; an output at a
    loop of symbolic links was exit 70 (`RuntimeError: Symlink loop`), in a search's --report too."""
    monkeypatch.chdir(tmp_path)
    assert energy(*toy_search(tmp_path, "--storage", "s.journal", "--report", "r.html"))[0] == 0
    refused(energy("report", "s.journal", "-o", ""), "-o/--output is empty")
    refused(energy("report", "s.journal", "--export", ""), "--export is empty")
    os.symlink("loop2", "loop1")
    os.symlink("loop1", "loop2")
    refused(energy("report", "s.journal", "-o", "loop1"), "-o/--output loop1 is a loop of symbolic links")
    refused(energy("report", "s.journal", "--export", "loop1"), "--export loop1 is a loop of symbolic links")
    refused(energy(*toy_search(tmp_path, "--storage", "s.journal", "--report", "loop1")), "loop of symbolic links")
    assert not (tmp_path / "report.html").exists() and os.path.islink("loop1") and os.path.islink("loop2")
