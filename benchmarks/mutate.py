"""Mutation testing (issue 16): plant one realistic bug at a time and check that a test notices.

The mutants are a curated, versioned table, ``benchmarks/mutants.toml``: each names a file, an
exact snippet of it (found exactly once), its replacement, a one-line description and the pytest
selection that should kill it; ``equivalent = "<reason>"`` marks a mutant that cannot change
behaviour (it is applied to check the snippet, but not run, and not counted).

The repository is never mutated in place (others work in it): its files (``git ls-files -co
--exclude-standard``, or ``git archive HEAD`` with ``--head``) are copied once to a temporary
directory, each mutant is written there, its selection is run by pytest in that copy (with
``PYTHONPATH`` pointing at it, so ``import hapc`` is the mutated copy), and the file is restored.
A mutant is *killed* when its selection fails, *survived* when it passes, *error* when the
snippet is missing or the run times out (a hang counts as an error, not a kill). The report,
``benchmarks/MUTATION.md``, has one row per mutant and the kill rate over the non-equivalent ones;
it is written from ``benchmarks/mutation.json``, the outcomes by id, so a run with ``-k`` updates
its rows and keeps the others (a mutant whose table entry changed since its outcome is "not run").

    python benchmarks/mutate.py                  # every mutant, writes benchmarks/MUTATION.md
    python benchmarks/mutate.py -k astar lp_mem  # mutants whose id contains any of the words
    python benchmarks/mutate.py --baseline       # run the selections unmutated (they must pass)
    python benchmarks/mutate.py --head           # mutate a copy of HEAD (others' uncommitted work left out)
    python benchmarks/mutate.py --report-only    # rewrite MUTATION.md from mutation.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "benchmarks" / "mutants.toml"
REPORT = ROOT / "benchmarks" / "MUTATION.md"
RESULTS = ROOT / "benchmarks" / "mutation.json"  # outcomes by id: a run with -k updates its rows


@dataclass
class Mutant:
    id: str
    file: str
    original: str
    replacement: str
    description: str
    tests: list[str]
    equivalent: str = ""
    timeout: int = 120
    env: dict[str, str] | None = None  # extra environment for the run (e.g. more hypothesis examples)
    note: str = ""  # what is known about a survivor (shown in the report)


@dataclass
class Outcome:
    mutant: Mutant
    status: str  # killed | survived | equivalent | error
    seconds: float
    detail: str = ""


def load(path: Path = TABLE) -> tuple[int, list[Mutant]]:
    data = tomllib.loads(path.read_text())
    mutants = [Mutant(**m) for m in data["mutant"]]
    ids = [m.id for m in mutants]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise SystemExit(f"{path}: duplicate mutant ids {sorted(dup)}")
    return data["version"], mutants


def copy_tree(dest: Path, head: bool) -> None:
    """The repository's files into ``dest`` (no .git, no .venv); ``hapc/models`` links the zoo."""
    if head:
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    else:
        files = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout.split(b"\0")
        for f in filter(None, files):
            src = ROOT / f.decode()
            if src.is_file():
                (dest / f.decode()).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest / f.decode())
    # the installed package maps hapc.models to models/ (package-dir); mirror that in the copy
    link = dest / "hapc" / "models"
    if not link.exists():
        link.symlink_to(Path("..") / "models")


def run_tests(copy: Path, tests: list[str], timeout: int, extra: dict[str, str] | None) -> tuple[int | None, str]:
    env = dict(os.environ, **(extra or {}))
    env.update(
        PYTHONPATH=str(copy),
        PYTHONDONTWRITEBYTECODE="1",  # a restored file must never be shadowed by a mutant's .pyc
        OMP_NUM_THREADS="1",
        HAPC_EXAMPLES=env.get("HAPC_EXAMPLES", "60"),
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:xdist", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(
            cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True
        )
    except subprocess.TimeoutExpired:
        return None, "timeout"
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return proc.returncode, lines[-1] if lines else ""


def check_copy(copy: Path) -> None:
    """Refuse to run when ``import hapc`` in the copy would not be the copy's hapc."""
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run(
        [sys.executable, "-c", "import hapc.balance.loop, hapc.models; print(hapc.balance.loop.__file__)"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
    )
    if not out.stdout.strip().startswith(str(copy)):
        raise SystemExit(f"the copy's hapc is not the one imported: {out.stdout}{out.stderr}")


def mutate_one(copy: Path, m: Mutant, baseline: bool) -> Outcome:
    path = copy / m.file
    source = path.read_text()
    n = source.count(m.original)
    if n != 1:
        return Outcome(m, "error", 0.0, f"snippet found {n} times in {m.file}")
    if m.equivalent and not baseline:
        return Outcome(m, "equivalent", 0.0, m.equivalent)
    t0 = time.perf_counter()
    try:
        if not baseline:
            path.write_text(source.replace(m.original, m.replacement))
        rc, last = run_tests(copy, m.tests, m.timeout, m.env)
    finally:
        path.write_text(source)
    dt = time.perf_counter() - t0
    if rc is None:
        return Outcome(m, "error", dt, f"timeout after {m.timeout} s")
    if baseline:
        return Outcome(m, "passed" if rc == 0 else "failed", dt, last)
    if rc in (0, 5):  # 5: no test collected -- the selection is wrong, which must not pass as a kill
        return Outcome(m, "survived" if rc == 0 else "error", dt, last)
    return Outcome(m, "killed", dt, last)


def merge(mutants: list[Mutant], outcomes: list[Outcome]) -> list[Outcome]:
    """Every mutant of the table with its latest outcome (saved in ``RESULTS``) or "not run"."""
    saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for o in outcomes:
        saved[o.mutant.id] = {"key": _key(o.mutant), "status": o.status, "seconds": o.seconds, "detail": o.detail}
    RESULTS.write_text(json.dumps(saved, indent=1, sort_keys=True) + "\n")
    merged = []
    for m in mutants:
        r = saved.get(m.id)
        if r is None or r["key"] != _key(m):
            merged.append(Outcome(m, "not run", 0.0))
        else:
            merged.append(Outcome(m, r["status"], r["seconds"], r["detail"]))
    return merged


def _key(m: Mutant) -> str:
    return repr((m.file, m.original, m.replacement, m.tests, m.equivalent, m.env))


def report(version: int, outcomes: list[Outcome]) -> str:
    counted = [o for o in outcomes if o.status not in ("equivalent", "not run")]
    killed = sum(o.status == "killed" for o in counted)
    rate = killed / len(counted) if counted else 0.0
    by = {s: sum(o.status == s for o in outcomes) for s in ("killed", "survived", "equivalent", "error", "not run")}
    out = [
        "# Mutation testing",
        "",
        "Generated by `make mutate` (`python benchmarks/mutate.py`) from `benchmarks/mutants.toml` "
        f"(version {version}); do not edit by hand.",
        "Each mutant is one realistic bug planted in a temporary copy of the repository; the tests named beside it "
        "are run there. *Killed*: they fail. *Survived*: they pass. *Equivalent*: cannot change behaviour (reason "
        "given), not counted. *Error*: the snippet is missing or the run timed out (counted as not killed).",
        "",
        f"**Kill rate: {killed} / {len(counted)} = {100 * rate:.1f} %** of non-equivalent mutants "
        f"(killed {by['killed']}, survived {by['survived']}, error {by['error']}, equivalent {by['equivalent']}"
        + (f", not run yet {by['not run']})." if by["not run"] else ")."),
        "",
        "| id | file | bug planted | tests | result | s |",
        "| --- | --- | --- | --- | --- | ---: |",
    ]
    notes = [o for o in outcomes if o.status != "killed" and o.mutant.note]
    for o in outcomes:
        m = o.mutant
        result = o.status if o.status in ("killed", "survived") else f"{o.status}: {o.detail}"
        tests = " ".join(f"`{t}`" for t in m.tests)
        out.append(
            f"| {m.id} | `{m.file}` | {m.description} | {tests} | {result.replace('|', '/')} | {o.seconds:.0f} |"
        )
    if notes:
        out += ["", "## Notes on mutants not killed", ""]
        out += [f"* **{o.mutant.id}** ({o.status}): {o.mutant.note}" for o in notes]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", nargs="*", default=[], help="run only mutants whose id contains one of these words")
    ap.add_argument("--baseline", action="store_true", help="run the selections unmutated; all must pass")
    ap.add_argument("--head", action="store_true", help="copy HEAD (git archive) instead of the working tree")
    ap.add_argument("--out", type=Path, default=REPORT, help="the report (default benchmarks/MUTATION.md)")
    ap.add_argument("--no-report", action="store_true", help="print only")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from benchmarks/mutation.json")
    args = ap.parse_args(argv)
    version, mutants = load()
    if args.report_only:
        args.out.write_text(report(version, merge(mutants, [])))
        return 0
    chosen = [m for m in mutants if not args.k or any(w in m.id for w in args.k)]
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="hapc-mutate-") as tmp:
        copy = Path(tmp)
        copy_tree(copy, args.head)
        check_copy(copy)
        for i, m in enumerate(chosen, 1):
            o = mutate_one(copy, m, args.baseline)
            outcomes.append(o)
            print(f"[{i}/{len(chosen)}] {m.id:32s} {o.status:10s} {o.seconds:6.1f}s  {o.detail[:90]}", flush=True)
    if args.baseline:
        bad = [o for o in outcomes if o.status != "passed"]
        print(f"baseline: {len(outcomes) - len(bad)} / {len(outcomes)} selections pass unmutated")
        return 1 if bad else 0
    if args.no_report:
        return 0
    outcomes = merge(mutants, outcomes)
    text = report(version, outcomes)
    print(next(line for line in text.splitlines() if line.startswith("**Kill rate")))
    args.out.write_text(text)
    counted = [o for o in outcomes if o.status not in ("equivalent", "not run")]
    killed = sum(o.status == "killed" for o in counted)
    return 0 if not counted or killed >= 0.95 * len(counted) else 1


if __name__ == "__main__":
    sys.exit(main())
