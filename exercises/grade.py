"""Grade the exercises: runs each exercise's pytest grader on your starter files and prints a summary.

    python exercises/grade.py               # every exercise
    python exercises/grade.py 03            # one (by number or by name: 03, 3, causal_blocks)
    python exercises/grade.py 01 02 -v      # several; extra pytest options after the names
    python exercises/grade.py --solutions   # grade the instructor's solutions instead (exercises/solutions/)

Exit status 0 when nothing failed (GPU checks skip, visibly, without a GPU), 1 otherwise.
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
    {test name: outcome}}}, pytest's output)."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    env[SOLUTIONS_VARIABLE] = "1" if solutions else ""
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "report.xml")
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", "-q",
               f"--junitxml={junit}", *[str(g) for _, g in exercises], *pytest_args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE if quiet else None, stderr=subprocess.STDOUT if quiet else None)
        results = {name: dict(passed=0, failed=0, skipped=0, tests={}) for name, _ in exercises}
        if os.path.exists(junit):
            for case in ET.parse(junit).getroot().iter("testcase"):
                where = case.get("classname", "") + "." + case.get("name", "")
                folder = next((n for n, _ in exercises if f".{n}." in f".{where}"), None)
                if folder is None:
                    continue
                if case.find("skipped") is not None:
                    outcome = "skipped"
                elif case.find("failure") is not None or case.find("error") is not None:
                    outcome = "failed"
                else:
                    outcome = "passed"
                results[folder][outcome] += 1
                results[folder]["tests"][case.get("name")] = outcome
    return results, (proc.stdout if quiet else ""), proc.returncode


def summary(results):
    lines = ["", f"{'exercise':22} {'passed':>6} {'failed':>6} {'skipped':>7}  result"]
    for name, r in results.items():
        total = r["passed"] + r["failed"] + r["skipped"]
        if total == 0:
            verdict = "NOT RUN (the grader did not load: see the error above)"
        elif r["failed"]:
            verdict = "FAIL"
        elif r["passed"] == 0:
            verdict = "SKIPPED (needs a GPU)"
        elif r["skipped"]:
            verdict = "PASS on the CPU checks; the GPU part was skipped, so not fully graded"
        else:
            verdict = "PASS"
        lines.append(f"{name:22} {r['passed']:6} {r['failed']:6} {r['skipped']:7}  {verdict}")
    return "\n".join(lines)


def main(argv):
    solutions = "--solutions" in argv
    argv = [a for a in argv if a != "--solutions"]
    names = [a for a in argv if not a.startswith("-")]
    extra = [a for a in argv if a.startswith("-")]
    exercises = select(names)
    print(f"grading {'the solutions in exercises/solutions/' if solutions else 'your starter files'}: "
          + ", ".join(n for n, _ in exercises), flush=True)
    # one exercise: short tracebacks; all of them: one line per failure (pass --tb=short to see more)
    tb = ["--tb=short"] if len(exercises) == 1 else ["--tb=line"]
    results, _, code = run(exercises, solutions=solutions, pytest_args=tb + extra)
    print(summary(results))
    failed = code != 0 and code != 5 or any(r["failed"] or not r["tests"] for r in results.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
