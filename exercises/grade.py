"""Grade the exercises: runs each exercise's pytest grader on your starter files and prints a summary.

    python exercises/grade.py               # every exercise
    python exercises/grade.py 03            # one (by number or by name: 03, 3, causal_blocks)
    python exercises/grade.py 01 02 -v      # several; extra pytest options after the names
    python exercises/grade.py --solutions   # grade the instructor's solutions instead (exercises/solutions/)
    python exercises/grade.py 02 --tb=long  # pytest's full traceback instead of the grader's message alone
    python exercises/grade.py 03 -- -k online   # after "--", everything goes to pytest as it is

Options of one word ("-x", "--tb=long") can follow the names; an option with a separate value ("-k NAME") goes
after "--", or NAME would be read as an exercise.

Exit status 0 when every exercise graded passed, 1 when one failed or could not be graded (an exercise
whose checks need something this machine lacks is reported NOT GRADED, never PASS).
"""
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

EXERCISES = Path(__file__).resolve().parent
ROOT = EXERCISES.parent
SOLUTIONS_VARIABLE = "FLASH_EXERCISE_SOLUTIONS"


def all_exercises():
    """[(folder name, grader file)] in order, e.g. ('03_causal_blocks', .../test_causal_blocks.py)."""
    out = []
    for folder in sorted(p for p in EXERCISES.iterdir() if p.is_dir() and p.name[:2].isdigit()):
        graders = sorted(folder.glob("test_*.py"))
        if graders:
            out.append((folder.name, graders[0]))
    return out


def select(names):
    exercises = all_exercises()
    if not names:
        return exercises
    chosen = []
    for name in names:
        hits = [e for e in exercises if e[0] == name or e[0][:2] == name.zfill(2) or e[0][3:] == name]
        if not hits:
            raise SystemExit(f"no exercise {name!r}; there are: " + ", ".join(e[0] for e in exercises))
        chosen += [h for h in hits if h not in chosen]
    return chosen


def run(exercises, solutions=False, pytest_args=(), quiet=False):
    """Run the graders in one pytest process. Returns ({folder: {'passed', 'failed', 'skipped', 'tests':
    {test name: outcome}, 'skip_reasons': [...], 'not_graded': [...]}}, pytest's output, its exit code).
    --assert=plain: a grader's message is the whole report (exercises/conftest.py), with none of the
    expression dumps pytest's assertion rewriting would add."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env[SOLUTIONS_VARIABLE] = "1" if solutions else ""
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "report.xml")
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-q", "--assert=plain",
               f"--junitxml={junit}", *[str(g) for _, g in exercises], *pytest_args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT if quiet else None)
        results = {name: dict(passed=0, failed=0, skipped=0, tests={}, skip_reasons=[], not_graded=[])
                   for name, _ in exercises}
        if os.path.exists(junit):
            for case in ET.parse(junit).getroot().iter("testcase"):
                where = case.get("classname", "") + "." + case.get("name", "")
                folder = next((n for n, _ in exercises if f".{n}." in f".{where}"), None)
                if folder is None:
                    continue
                skipped, failure = case.find("skipped"), case.find("failure")
                failure = failure if failure is not None else case.find("error")
                if skipped is not None:
                    outcome = "skipped"
                    reason = skipped.get("message", "").removeprefix("Skipped: ")
                    if reason not in results[folder]["skip_reasons"]:
                        results[folder]["skip_reasons"].append(reason)
                elif failure is not None:
                    outcome = "failed"
                    message = failure.get("message", "")
                    if message.startswith("NOT GRADED"):                  # a check that could not run at all
                        results[folder]["not_graded"].append(message)
                else:
                    outcome = "passed"
                results[folder][outcome] += 1
                results[folder]["tests"][case.get("name")] = outcome
    return results, (proc.stdout if quiet else ""), proc.returncode


def verdict(r):
    """One of PASS, FAIL, NOT GRADED, NOT RUN, and what to know about it."""
    total = r["passed"] + r["failed"] + r["skipped"]
    if total == 0:
        return "NOT RUN (the grader did not load: see the error above)"
    if r["not_graded"] and r["failed"] == len(r["not_graded"]):
        return "NOT GRADED: " + r["not_graded"][0].split("\n")[0].removeprefix("NOT GRADED: ")
    if r["failed"]:
        return "FAIL"
    if r["passed"] == 0:
        return "NOT GRADED: every check was skipped (" + "; ".join(r["skip_reasons"]) + ")"
    if r["skipped"]:
        return "PASS; not run here: " + "; ".join(r["skip_reasons"])
    return "PASS"


def summary(results):
    lines = ["", f"{'exercise':22} {'passed':>6} {'failed':>6} {'skipped':>7}  result"]
    for name, r in results.items():
        lines.append(f"{name:22} {r['passed']:6} {r['failed']:6} {r['skipped']:7}  {verdict(r)}")
    return "\n".join(lines)


def main(argv):
    if "-h" in argv or "--help" in argv:
        print(__doc__.strip())
        return 0
    argv, passed_on = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    solutions = "--solutions" in argv
    argv = [a for a in argv if a != "--solutions"]
    names = [a for a in argv if not a.startswith("-")]
    extra = [a for a in argv if a.startswith("-")] + passed_on
    exercises = select(names)
    print(f"grading {'the solutions in exercises/solutions/' if solutions else 'your starter files'}: "
          + ", ".join(n for n, _ in exercises), flush=True)
    results, _, code = run(exercises, solutions=solutions, pytest_args=extra)
    print(summary(results))
    ok = code in (0, 5) and all(verdict(r).startswith("PASS") for r in results.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
