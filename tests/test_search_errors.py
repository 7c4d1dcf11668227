"""Bad input to `energy search` / `energy report` (and their API): a clear message naming the problem and exit
status 2, before any trial runs; never an internal error (exit 70) or a traceback, never lost work.

The engine's side, on the toy space (no DSL, no torch); the DSL's settings and holes are in
tests/test_search_dsl.py. Every storage here is a real Optuna journal (or SQLite file) in tmp_path.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from conftest import within
from optuna.trial import TrialState

from energydsl.errors import UserError
from energydsl.search import SpaceRef, load_study, open_storage, run_search, write_report

ROOT = Path(__file__).resolve().parents[1]
CLI = "import sys\nfrom energydsl import cli\nsys.argv[0] = 'energy'\ncli.main()\n"


def toy(tmp_path: Path, **sets: object) -> SpaceRef:
    base = {"calls": str(tmp_path / "calls.txt"), "sleep": "0", "mixers": "ssm,attn"}
    base.update({k: str(v) for k, v in sets.items()})
    return SpaceRef("energydsl.search.toy:make_space", base)


def energy(*args: str, cwd: Path, **popen: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **popen.pop("env", {})}  # type: ignore[dict-item]
    return subprocess.run([sys.executable, "-c", CLI, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120, **popen)  # type: ignore[call-overload]


def clean_exit_2(r: subprocess.CompletedProcess[str], *words: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "internal error" not in r.stderr, r.stderr[-2000:]
    for w in words:
        assert w in r.stderr, r.stderr[-2000:]


def a_study(tmp_path: Path, name: str = "t") -> Path:
    """A journal holding one finished toy study."""
    journal = tmp_path / "study.journal"
    run_search(toy(tmp_path), storage=str(journal), study_name=name, trials=1, progress=False, json=True)
    return journal


# ----------------------------------------------------------------------------- 1. storages


def bad_storages(tmp_path: Path) -> list[tuple[str, str]]:
    """(storage, what the message says) for paths that are no journal and cannot become one."""
    (tmp_path / "notes.txt").write_text("some notes\nmore\n")
    (tmp_path / "partial.txt").write_text("one line, no newline")  # Optuna would append to this one
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "fake.journal").write_text('{"a": 1}\n')
    out = [(str(tmp_path), "is a directory")]
    no_journal = ("notes.txt", "partial.txt", "blob.bin", "fake.journal")
    out += [(str(tmp_path / n), "not an Optuna journal") for n in no_journal]
    out += [(str(tmp_path / "notes.txt" / "x.journal"), "cannot create the storage")]
    out += [(f"{d}/x.journal", "cannot create the storage") for d in ("/proc", "/sys") if os.path.isdir(d)]
    return out


def test_bad_storage_paths_are_user_errors_naming_the_path(tmp_path: Path) -> None:
    storages = bad_storages(tmp_path)
    before = {p: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    for storage, message in storages:
        with pytest.raises(UserError) as e:
            open_storage(storage)
        assert storage in e.value.message and message in e.value.message, (storage, e.value.message)
        with pytest.raises(UserError, match=message):  # also as the search's --storage
            run_search(toy(tmp_path), storage=storage, study_name="t", trials=1, progress=False, json=True)
    assert {p: p.read_bytes() for p in before} == before  # nothing appended to a file that is no journal
    assert not (tmp_path / "calls.txt").exists()  # no trial ran


def test_cli_bad_storage_exits_2(tmp_path: Path) -> None:
    (tmp_path / "tiny.txt").write_text("not a journal\n")
    clean_exit_2(energy("search", "toy", "--storage", str(tmp_path), cwd=tmp_path), "is a directory")
    clean_exit_2(energy("report", "tiny.txt", cwd=tmp_path), "tiny.txt is not an Optuna journal")
    clean_exit_2(energy("report", "Quickstart", "--storage", str(tmp_path), cwd=tmp_path), "is a directory")
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- 2. output paths


def test_search_checks_its_output_paths_before_any_trial(tmp_path: Path) -> None:
    journal = str(tmp_path / "s.journal")
    for flag, path, message in [("--report", str(tmp_path), "is a directory"),
                                ("--export", str(tmp_path), "is a directory"),
                                ("--report", str(tmp_path / "file.txt" / "r.html"),
                                 f"cannot write a file there ({tmp_path / 'file.txt'} is a file, not a directory)"),
                                ("--storage", str(tmp_path / "file.txt" / "s.journal"),
                                 f"cannot create the storage {tmp_path / 'file.txt' / 's.journal'}: "
                                 f"{tmp_path / 'file.txt'} is a file, not a directory")]:
        (tmp_path / "file.txt").write_text("x")
        r = energy("search", "toy", "--set", f"calls={tmp_path / 'calls.txt'}", "--set", "sleep=0", "--trials", "1",
                   *(["--storage", journal] if flag != "--storage" else []), flag, path, cwd=tmp_path)
        clean_exit_2(r, *([flag] if flag != "--storage" else []), message)
    assert not (tmp_path / "calls.txt").exists() and not Path(journal).exists()  # no trial ran, no study made
    # --export at --report's file: the candidate replaced the report without a word
    same = str(tmp_path / "same.out")
    r = energy("search", "toy", "--set", f"calls={tmp_path / 'calls.txt'}", "--set", "sleep=0", "--trials", "1",
               "--storage", journal, "--report", same, "--export", same, cwd=tmp_path)
    clean_exit_2(r, f"--export {same} is also --report: the one would replace the other")
    assert not (tmp_path / "calls.txt").exists()
    # --export at the default report's file, known once the search knows its storage: refused before either write
    report = Path(journal).parent / "report.html"
    r = energy("search", "toy", "--set", f"calls={tmp_path / 'calls.txt'}", "--set", "sleep=0", "--trials", "1",
               "--storage", journal, "--export", str(report), cwd=tmp_path)
    clean_exit_2(r, f"--export {report} is also the report: the one would replace the other")
    assert not report.exists() and Path(journal).exists()  # the study is kept: `energy report` writes it later


def test_report_checks_its_output_paths_before_writing(tmp_path: Path) -> None:
    journal = a_study(tmp_path)
    (tmp_path / "file.txt").write_text("x")
    clean_exit_2(energy("report", str(journal), "-o", str(tmp_path), cwd=tmp_path), "is a directory")
    clean_exit_2(energy("report", str(journal), "-o", str(tmp_path / "file.txt" / "r.html"), cwd=tmp_path),
                 f"cannot write a file there ({tmp_path / 'file.txt'} is a file, not a directory)")
    r = energy("report", str(journal), "-o", str(tmp_path / "r.html"), "--export", str(tmp_path), cwd=tmp_path)
    clean_exit_2(r, "--export", "is a directory")
    assert not (tmp_path / "r.html").exists()  # refused before writing anything
    for out in (["-o", str(tmp_path / "r.html")], []):  # at -o's file, or at the default report's
        target = str(tmp_path / "r.html") if out else str(journal.parent / "report.html")
        r = energy("report", str(journal), *out, "--export", target, cwd=tmp_path)
        clean_exit_2(r, f"--export {target} is also {'-o/--output' if out else 'the report'}")
        assert not Path(target).exists()
    with pytest.raises(UserError, match="cannot write"):  # the API: no OSError either
        write_report(str(journal), "t", tmp_path)


# ----------------------------------------------------------------------------- 3, 4. flags


@pytest.mark.parametrize("flags, message", [
    (["--seed", "-1"], "seed must be between 0 and 2**32 - 1"),
    (["--seed", str(2**32)], "seed must be between 0 and 2**32 - 1"),
    (["--timeout", "-5"], "timeout must be a positive number"),
    (["--timeout", "0"], "timeout must be a positive number"),
])
def test_bad_search_flags_exit_2_before_any_trial(tmp_path: Path, flags: list[str], message: str) -> None:
    journal = tmp_path / "s.journal"
    r = energy("search", "toy", "--set", f"calls={tmp_path / 'calls.txt'}", "--trials", "1", "--storage", str(journal),
               *flags, cwd=tmp_path)
    clean_exit_2(r, message)
    assert not journal.exists() and not (tmp_path / "calls.txt").exists()


def test_bad_ray_resources_are_refused_before_ray_starts(tmp_path: Path) -> None:
    for gpus, cpus in ((-1, 1), (0, 0)):
        with pytest.raises(UserError, match="gpus_per_trial >= 0 and cpus_per_trial > 0"):
            run_search(toy(tmp_path), backend="ray", gpus_per_trial=gpus, cpus_per_trial=cpus,
                       storage=str(tmp_path / "s.journal"), trials=1, progress=False, json=True)
    assert not (tmp_path / "s.journal").exists()


@pytest.fixture
def not_ray() -> Iterator[str]:
    """HOST:PORT of a TCP server that is not Ray's (a web server's answer): a wrong port that answers."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                with conn:
                    conn.recv(1024)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    threading.Thread(target=serve, daemon=True).start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()


@pytest.mark.parametrize("address, message", [
    ("127.0.0.1:1", "cannot reach the Ray cluster at --address 127.0.0.1:1"),  # a wrong port: no hang
    ("NOT_RAY", "something answers there that is not a Ray cluster"),  # Ray's retries hung for minutes
    ("garbage", "--address 'garbage' is not a Ray cluster's address"),  # the study was created first
    ("localhost:notaport", "--address 'localhost:notaport' is not a Ray cluster's address"),
    # a scheme Ray does not take read as a host name: "Name or service not known"
    ("http://127.0.0.1:6379", "--address 'http://127.0.0.1:6379' is not a Ray cluster's address"),
])
def test_a_ray_address_that_cannot_be_joined_exits_2(tmp_path: Path, not_ray: str, address: str,
                                                     message: str) -> None:
    pytest.importorskip("ray")
    address = address.replace("NOT_RAY", not_ray)
    r = energy("search", "toy", "--backend", "ray", "--address", address, "--trials", "1",
               "--storage", str(tmp_path / "s.journal"), cwd=tmp_path)
    clean_exit_2(r, message.replace("NOT_RAY", not_ray), "hint: ")
    # said before the study is created: no empty study, lock or Ray log behind
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())


@pytest.mark.slow
def test_a_cluster_with_token_authentication_says_how_to_join_it(tmp_path: Path) -> None:
    """A cluster started with token authentication (Ray's default for `ray start` since 2.59) refused a search
    joining by HOST:PORT without RAY_AUTH_MODE=token; the hint said to start a cluster, which was running."""
    pytest.importorskip("ray")
    import shutil
    import tempfile

    ray_cli = Path(sys.executable).with_name("ray")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    head = subprocess.Popen([str(ray_cli), "start", "--head", "--block", "--port", str(port), "--num-cpus", "1",
                             "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", temp],
                            env={**env, "RAY_AUTH_MODE": "token"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:  # the head's GCS listens once it is up
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and head.poll() is None, "the Ray head did not start"
                time.sleep(0.5)
        r = energy("search", "toy", "--backend", "ray", "--address", f"127.0.0.1:{port}", "--trials", "1",
                   "--storage", str(tmp_path / "s.journal"), cwd=tmp_path, env={"RAY_AUTH_MODE": ""})
        clean_exit_2(r, f"cannot join the Ray cluster at --address 127.0.0.1:{port}",
                     "needs RAY_AUTH_MODE=token here, and its token")
        assert "start it with `ray start --head`" not in r.stderr
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` stops what it started
        head.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)


def test_more_gpus_per_trial_than_a_local_ray_runtime_has_exits_2(tmp_path: Path) -> None:
    """Tune would wait forever for a GPU this machine does not have."""
    pytest.importorskip("ray")
    import torch

    gpus = torch.cuda.device_count() + 1
    r = energy("search", "toy", "--backend", "ray", "--gpus-per-trial", str(gpus), "--trials", "1",
               "--storage", str(tmp_path / "s.journal"), cwd=tmp_path)
    clean_exit_2(r, f"--gpus-per-trial {gpus}: this machine has", "no trial could start")
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # no empty study left


def test_a_rerun_with_other_settings_exits_2_naming_them(tmp_path: Path) -> None:
    """(The first run's trial must train: a study whose trials all failed may change its settings. The toy's
    `diverge` choice fails, so the mixer is fixed.)"""
    journal = str(tmp_path / "s.journal")
    base = ["search", "toy", "--set", f"calls={tmp_path / 'calls.txt'}", "--set", "sleep=0", "--set", "mixers=ssm",
            "--storage", journal]
    assert energy(*base, "--set", "steps=4", "--trials", "1", cwd=tmp_path).returncode == 0
    r = energy(*base, "--set", "steps=2", "--trials", "2", cwd=tmp_path)
    clean_exit_2(r, "searched with other settings: steps: 4 → 2", "--study", "steps = 4")
    assert len(load_study(journal, "toy").trials) == 1  # nothing ran
    r = energy(*base, "--set", "steps=4", "--trials", "2", "--workers", "2", cwd=tmp_path)  # budget, workers
    assert r.returncode == 0, r.stderr[-2000:]


# ----------------------------------------------------------------------------- 6. Ctrl-C


def session_processes(sid: int) -> list[str]:
    ps = subprocess.run(["ps", "-eo", "sid=,pid=,args="], capture_output=True, text=True).stdout
    return [line.strip() for line in ps.splitlines() if line.split() and line.split()[0] == str(sid)]


def signal_search(tmp_path: Path, args: list[str], sig: signal.Signals, running: int,
                  calls: Path | None = None) -> tuple[int, str]:
    """Run `energy search` in a subprocess, send it `sig` once `running` of its trials run (and, with `calls`,
    have begun training: the toy's `calls` file): (status, stderr). It must leave no process behind (workers,
    a Ray runtime it started: all in its session)."""
    journal = args[args.index("--storage") + 1]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", CLI, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 60
        while time.time() < deadline:  # wait for the trials to run (4 steps of 1 s)
            with contextlib.suppress(UserError):  # the study may not be there yet
                if (sum(t.state == TrialState.RUNNING for t in load_study(journal, "toy").trials) >= running
                        and (calls is None or (calls.exists() and len(calls.read_text().splitlines()) >= running))):
                    break
            time.sleep(0.2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.time() + 10
    while session_processes(proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not session_processes(proc.pid), session_processes(proc.pid)
    return proc.returncode, err


@pytest.mark.parametrize("backend", ["local", pytest.param("ray", marks=pytest.mark.slow)])
def test_ctrl_c_exits_130_and_the_rerun_continues(tmp_path: Path, backend: str) -> None:
    """Ctrl-C hands the running trial back (interrupted), writes the report and exits 130, on Ray too, whose
    Tune handler took SIGINT for itself (`fit` returned as if the search were done: status 0)."""
    if backend == "ray":
        pytest.importorskip("ray")
    journal, calls = tmp_path / "s.journal", tmp_path / "calls.txt"
    args = ["search", "toy", "--set", "mixers=ssm", "--set", "sleep=1", "--set", f"calls={calls}", "--trials", "1",
            "--storage", str(journal), "--backend", backend]
    code, err = signal_search(tmp_path, args, signal.SIGINT, running=1, calls=calls)
    assert code == 130, err[-2000:]
    assert "interrupted: run the same command again" in err and "Traceback" not in err
    assert (tmp_path / "report.html").exists()
    ts = load_study(str(journal), "toy").trials
    assert [t.user_attrs.get("kind") for t in ts if t.state == TrialState.FAIL] == ["interrupted"]
    assert not any(t.state == TrialState.RUNNING for t in ts)
    r = energy(*[a if a != "sleep=1" else "sleep=0" for a in args], "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    assert (s["finished"], s["completed"], s["lost"]) == (1, 1, 1)  # the interrupted trial ran again, once


@pytest.mark.parametrize("backend, workers", [("local", 1), ("local", 2),
                                              pytest.param("ray", 1, marks=pytest.mark.slow)])
def test_sigterm_hands_the_trials_back_writes_the_report_and_exits_143(tmp_path: Path, backend: str,
                                                                       workers: int) -> None:
    """A batch scheduler's SIGTERM (to the driver only) acts as Ctrl-C: the running trials are `interrupted`
    (retried, not held against them as `lost` would be), the report is written, and the status is 143. On Ray
    too, whose own SIGTERM handler exited with status 1, no report (and a runtime it started is shut down)."""
    if backend == "ray":
        pytest.importorskip("ray")
    journal, calls = tmp_path / "s.journal", tmp_path / "calls.txt"
    args = ["search", "toy", "--set", "mixers=ssm", "--set", "sleep=1", "--set", f"calls={calls}", "--trials",
            str(workers), "--storage", str(journal), "--workers", str(workers), "--backend", backend]
    code, err = signal_search(tmp_path, args, signal.SIGTERM, running=workers, calls=calls)
    assert code == 143, err[-2000:]
    assert "interrupted: run the same command again" in err and "Traceback" not in err
    assert (tmp_path / "report.html").exists()
    ts = load_study(str(journal), "toy").trials
    assert [t.user_attrs.get("kind") for t in ts if t.state == TrialState.FAIL] == ["interrupted"] * workers
    assert not any(t.state == TrialState.RUNNING for t in ts)
    r = energy(*[a if a != "sleep=1" else "sleep=0" for a in args], "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    s = json.loads(r.stdout)
    assert (s["finished"], s["completed"], s["lost"]) == (workers, workers, workers)


def test_sigterm_while_ray_starts_exits_143_and_the_rerun_continues(tmp_path: Path) -> None:
    """SIGTERM in the first seconds, while ray.init ran (the study is there, no trial yet), met Ray's handler:
    exit 15 with no word, or 1; the runtime it had begun was not shut down (it was not yet "initialized")."""
    pytest.importorskip("ray")
    journal = tmp_path / "s.journal"
    args = ["search", "toy", "--set", "mixers=ssm", "--set", "sleep=0", "--trials", "1", "--storage", str(journal),
            "--backend", "ray", "--json"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", CLI, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 60
        while not journal.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.5)  # into ray.init, which takes seconds
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-2000:]
    assert "interrupted: run the same command again" in err and "Traceback" not in err, err[-2000:]
    deadline = time.time() + 10  # Ray's agents may outlive an interrupted start by a minute; its core goes now
    while any("raylet" in p or "gcs_server" in p for p in session_processes(proc.pid)) and time.time() < deadline:
        time.sleep(0.2)
    assert not any("raylet" in p or "gcs_server" in p for p in session_processes(proc.pid))
    r = energy(*args, cwd=tmp_path)
    assert r.returncode == 0 and json.loads(r.stdout)["finished"] == 1, r.stderr[-2000:]

# ----------------------------------------------------------------------------- 7. storage strings, locks


def test_an_empty_storage_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="storage is empty"):
        run_search(toy(tmp_path), storage="", trials=1, progress=False, json=True)
    with pytest.raises(UserError, match="storage is empty"):
        open_storage(" ")
    clean_exit_2(energy("search", "toy", "--storage", "", cwd=tmp_path), "storage is empty")
    clean_exit_2(energy("report", "toy", "--storage", "", cwd=tmp_path), "--storage is empty")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "calls.txt").exists()


def test_sqlite_lock_lives_next_to_the_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from energydsl.search.storage import lock_path

    work, db = tmp_path / "work", tmp_path / "db" / "s.db"
    work.mkdir()
    db.parent.mkdir()
    monkeypatch.chdir(work)
    url = f"sqlite:///{db}"
    s = run_search(toy(tmp_path), storage=url, study_name="q", trials=1, progress=False, json=True)
    assert s["finished"] == 1
    assert (db.parent / ".q.lock").exists() and lock_path(url, "q") == db.parent.resolve() / ".q.lock"
    assert not (work / "runs").exists()  # nothing in the working directory
    server = lock_path("postgresql://u@host/db", "q")  # a server: one lock per URL on this host, not per cwd
    assert work not in server.parents and server == lock_path("postgresql://u@host/db", "q")
    # the same file named with SQLAlchemy's driver: the same lock, whichever way a worker spells it
    assert lock_path(f"sqlite+pysqlite:///{db}", "q") == lock_path(url, "q")
    assert lock_path(f"SQLite:///{db}?timeout=5", "q") == lock_path(url, "q")


_RACE = """
import sys, time
from energydsl.search import SpaceRef, open_study, resolve_space
go, n, base = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
space = resolve_space(SpaceRef("energydsl.search.toy:make_space", {"mixers": "ssm,attn"}))
for i in range(n):
    while time.time() < go + 0.3 * i:  # both processes open database i at the same moment
        pass
    open_study(f"sqlite:///{base}/db{i}/s.db", "t", space)
"""


def test_two_commands_creating_one_new_sqlite_storage_both_open_it(tmp_path: Path) -> None:
    """Optuna creates a new database's tables without a transaction: two searches starting at once on a new
    SQLite file used to fail (`table studies already exists`, `UNIQUE constraint failed: alembic_version`)."""
    n = 6
    for i in range(n):
        (tmp_path / f"db{i}").mkdir()
    go = time.time() + 4  # after both have imported
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, str(go), str(n), str(tmp_path)], env=env,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-1500:] for e in errs]
    for i in range(n):
        assert optuna.get_all_study_names(open_storage(f"sqlite:///{tmp_path}/db{i}/s.db")) == ["t"]


def test_an_existing_journal_still_opens(tmp_path: Path) -> None:
    """The journal check accepts what Optuna writes (and an empty file)."""
    journal = a_study(tmp_path)
    assert optuna.get_all_study_names(open_storage(str(journal))) == ["t"]
    (tmp_path / "empty.journal").write_text("")
    assert optuna.get_all_study_names(open_storage(str(tmp_path / "empty.journal"))) == []


def test_a_space_saved_with_a_byte_order_mark_lists_its_holes(tmp_path: Path) -> None:
    """The language ignores a leading BOM; the hole finder reads the file as the parser does."""
    space = tmp_path / "bom.energy"
    space.write_bytes(b"\xef\xbb\xbf" + (ROOT / "search/quickstart.energy").read_bytes())
    out = energy("search", str(space), "--holes", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "TinyGPT.d" in out.stdout and "choice{32, 64}" in out.stdout


def test_a_python_space_lists_its_holes_or_says_it_cannot(tmp_path: Path) -> None:
    """`--holes` on a Python space: its `distributions()` (the toy space's, less what an option fixes), or a notice
    that it lists none. It printed nothing and exited 0 for either."""
    out = energy("search", "toy", "--holes", "--set", "depth=2", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert [(r["name"], r["values"]) for r in json.loads(out.stdout)] == [
        ("mixer", "choice{ssm, attn, attn_alias, bogus, diverge}"), ("lr", "float 0.0001..0.1 log")]
    (tmp_path / "bare_space.py").write_text(
        "from energydsl.search.toy import make_space\n"
        "class Bare:  # suggest and evaluate only: no listing of its holes\n"
        "    def __init__(self):\n"
        "        self.toy = make_space()\n"
        "        self.name, self.objectives, self.budget = 'bare', self.toy.objectives, self.toy.budget\n"
        "    def suggest(self, trial):\n"
        "        return self.toy.suggest(trial)\n"
        "    def evaluate(self, *args):\n"
        "        return self.toy.evaluate(*args)\n")
    out = energy("search", "bare_space:Bare", "--holes", cwd=tmp_path,
                 env={"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})
    assert out.returncode == 0 and out.stdout == "", out
    assert "space 'bare' does not list its holes" in out.stderr and "distributions()" in out.stderr


def test_the_report_and_best_files_get_the_mode_open_would_give(tmp_path: Path) -> None:
    from energydsl.search import export_best

    journal = a_study(tmp_path)
    old = os.umask(0o027)
    try:
        report = write_report(str(journal), "t", tmp_path / "r.html")
        export_best(str(journal), "t", tmp_path / "best.energy")
    finally:
        os.umask(old)
    assert oct(report.stat().st_mode & 0o777) == oct(0o640)  # not mkstemp's 0600: others may read it
    assert oct((tmp_path / "best.energy").stat().st_mode & 0o777) == oct(0o640)


def test_a_rerun_before_any_trial_trained_may_change_the_settings(tmp_path: Path) -> None:
    """A run that only made its budget slots (or whose trials all failed, e.g. out of memory) has no results
    to compare with: another `steps` (a smaller batch) is allowed then."""
    from energydsl.search import open_study, resolve_space
    from energydsl.search.local import ensure_slots

    journal = str(tmp_path / "s.journal")
    study = open_study(journal, "t", resolve_space(toy(tmp_path, steps=4)))
    ensure_slots(study, 2)  # what run_local does before the first trial runs
    assert open_study(journal, "t", resolve_space(toy(tmp_path, steps=2))).user_attrs["settings"]["steps"] == "2"


def test_a_dtype_the_device_cannot_run_is_refused_before_any_trial(tmp_path: Path, corpus: Path) -> None:
    r = energy("search", str(ROOT / "search" / "quickstart.energy"), "--set", f"data=chars:{corpus}", "--set",
               "dtype=float16", "--trials", "1", "--device", "cpu", "--storage", str(tmp_path / "s.journal"),
               cwd=tmp_path)
    clean_exit_2(r, "--set dtype=float16: dtype float16 needs CUDA")
    assert not (tmp_path / "s.journal").exists()


# ----------------------------------------------------------------------------- a journal a crash left behind


@pytest.mark.parametrize("damage", ["cut short", "not JSON"])
def test_a_damaged_last_record_of_the_journal_is_set_aside_and_the_search_continues(tmp_path: Path,
                                                                                    damage: str) -> None:
    """A full disk or a kill mid-append leaves a last line without its newline; a last line that is not JSON
    reads alike. Optuna reads past either, but the rerun's first append followed it: exit 70 (JSONDecodeError at
    the next read), and the study unreadable for good."""
    journal = tmp_path / "s.journal"
    base = ["search", "toy", "--set", f"calls={tmp_path / 'calls.txt'}", "--set", "sleep=0", "--set", "mixers=ssm",
            "--storage", str(journal)]
    assert energy(*base, "--trials", "1", cwd=tmp_path).returncode == 0
    whole = journal.read_bytes()
    if damage == "cut short":
        journal.write_bytes(whole[:-37])  # the last record (the trial's end) cut short
        set_aside = whole[whole[:-37].rfind(b"\n") + 1:-37] + b"\n"
    else:
        set_aside = b"garbage\xff\n"
        journal.write_bytes(whole + set_aside)
    r = energy(*base, "--trials", "2", cwd=tmp_path)
    said = {"cut short": "ended in a record cut short (", "not JSON": "ended in a record that is not JSON ("}
    assert r.returncode == 0 and said[damage] in r.stderr, r.stderr[-2000:]
    assert journal.with_name("s.journal.torn").read_bytes() == set_aside
    assert all(json.loads(line) for line in journal.read_bytes().splitlines())  # every record whole
    trials = load_study(str(journal), "toy").get_trials()
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 2, trials
    write_report(str(journal), "toy", tmp_path / "r.html")


def test_a_journal_damaged_before_its_last_record_is_refused_naming_the_line(tmp_path: Path) -> None:
    """Records after a damaged one cannot be replayed in order: a clear refusal that names the line, exit 2."""
    journal = tmp_path / "s.journal"
    base = ["search", "toy", "--set", f"calls={tmp_path / 'calls.txt'}", "--set", "sleep=0", "--set", "mixers=ssm",
            "--storage", str(journal)]
    assert energy(*base, "--trials", "1", cwd=tmp_path).returncode == 0
    lines = journal.read_bytes().splitlines(keepends=True)
    journal.write_bytes(b"".join(lines[:2] + [b"garbage\n"] + lines[2:]))
    clean_exit_2(energy(*base, "--trials", "2", cwd=tmp_path), f"storage {journal} is not a readable Optuna "
                 "journal (line 3 is not a JSON record)", "restore a copy")


def test_a_full_disk_names_the_journal_it_could_not_write(tmp_path: Path, monkeypatch, capsys) -> None:
    """A full disk fails in write() or fsync(), whose OSError has no file name: the message said `cannot write:
    No space left on device` without saying what."""
    from energydsl import cli

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    journal = tmp_path / "s.journal"
    monkeypatch.setattr(os, "fsync", full)
    monkeypatch.setattr(sys, "argv", ["energy", "search", "toy", "--set", f"calls={tmp_path / 'calls.txt'}",
                                      "--trials", "1", "--storage", str(journal)])
    with pytest.raises(SystemExit) as stop:
        cli.main()
    assert stop.value.code == 2
    assert f"error: cannot write {journal.resolve()}: No space left on device" in capsys.readouterr().err


def test_a_cut_short_record_longer_than_a_read_block_is_set_aside_whole(tmp_path: Path, capsys) -> None:
    """The tail is looked for block by block (64 KiB) from the end: a longer one must not cut a whole record."""
    journal = a_study(tmp_path)
    whole = journal.read_bytes()
    journal.write_bytes(whole + b'{"op_code": 4, "x": "' + b"a" * 200_000)
    open_storage(str(journal), append=True)
    assert journal.read_bytes() == whole and "ended in a record cut short (200021 bytes" in capsys.readouterr().err
    assert optuna.get_all_study_names(open_storage(str(journal))) == ["t"]


def test_a_stale_journal_lock_that_points_nowhere_is_cleared(tmp_path: Path, monkeypatch, capsys) -> None:
    """Optuna's lock is a symlink to the journal, and its grace period stats the target: a relative link (as a
    relative --storage, the default runs/STUDY/optuna.journal, made it) or one from a moved folder points nowhere,
    and a search after a kill mid-append spun on it for ever."""
    monkeypatch.chdir(tmp_path)
    a_study(tmp_path)
    os.makedirs("runs/t")
    os.replace("study.journal", "runs/t/optuna.journal")
    os.symlink("runs/t/optuna.journal", "runs/t/optuna.journal.lock")  # as a killed append left it
    capsys.readouterr()
    with within(90, "a search spins on a lock"):
        run_search(toy(tmp_path), storage="runs/t/optuna.journal", study_name="t", trials=2, progress=False,
                   json=True)
    assert "removed a stale lock of the journal" in capsys.readouterr().err
    assert not os.path.lexists("runs/t/optuna.journal.lock")
    assert sum(t.state == TrialState.COMPLETE for t in load_study("runs/t/optuna.journal", "t").get_trials()) == 2


def test_a_journal_record_of_an_unknown_kind_is_a_damaged_journal(tmp_path: Path) -> None:
    """Optuna's replay asserts on an op code it does not know (`AssertionError: Should not reach.`, exit 70)."""
    journal = a_study(tmp_path)
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join([*lines[:2], '{"op_code": 99}\n', *lines[3:]]))
    with pytest.raises(UserError, match=f"storage {journal} is not a readable Optuna journal"):
        open_storage(str(journal))


def test_register_and_resolve_space_name_a_wrong_argument(tmp_path: Path) -> None:
    """None and "" were registered as names, `toy` was silently replaced, a target of None failed in a regex, and a
    Path to a .energy space was an AttributeError."""
    from energydsl.search import register_space, resolve_space

    for name, target, says in ((None, "energydsl.search.toy:make_space", "the name must be a non-empty string"),
                               ("", "energydsl.search.toy:make_space", "the name must be a non-empty string"),
                               ("toy", "energydsl.search.toy:make_space", "that name is the engine's own space"),
                               ("mine", None, "None is not of the form package.module:attr")):
        with pytest.raises(ValueError, match=says):
            register_space(name, target)
    with pytest.raises(UserError, match="a search space is a .energy path, a registered name or package.module:attr"):
        resolve_space(None)
    assert resolve_space(ROOT / "search" / "quickstart.energy").name == "Quickstart"
