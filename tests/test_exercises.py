"""The exercises' graders work: each FAILS on its untouched starter and PASSES on its solution.

Runs exercises/grade.py's graders in two pytest processes at once (starters, and solutions with
FLASH_EXERCISE_SOLUTIONS=1). The CUDA exercise's kernel runs on the CPU (built with a C++ compiler, one
thread per CUDA thread) and, where there is one, on the GPU; its nvcc compile check skips, visibly,
without nvcc. Also: the summary never says PASS for an exercise whose checks all skipped.
"""
import shutil
import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("exercises_grade", ROOT / "exercises" / "grade.py")
grade = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grade)

EXERCISES = grade.all_exercises()
NAMES = [name for name, _ in EXERCISES]
CUDA_EXERCISE = "07_cuda_forward"
COMPILE_TEST = "test_compiles_with_nvcc"
HAS_CXX = any(shutil.which(c) for c in ("c++", "g++", "clang++"))


@pytest.fixture(scope="module")
def graded():
    """Both graders' runs at once: each builds its own extension of exercise 07 (half a minute on a fresh machine)."""
    with ThreadPoolExecutor(2) as pool:
        runs = {solutions: pool.submit(grade.run, EXERCISES, solutions=solutions, quiet=True,
                                       pytest_args=["--tb=short" if solutions else "--tb=no"])
                for solutions in (False, True)}
        return {solutions: run.result()[:2] for solutions, run in runs.items()}


@pytest.fixture(scope="module")
def starters(graded):
    return graded[False]


@pytest.fixture(scope="module")
def solutions(graded):
    return graded[True]


def test_there_are_at_least_eight_exercises():
    assert len(EXERCISES) >= 8, NAMES
    assert CUDA_EXERCISE in NAMES
    for name in NAMES:
        folder = ROOT / "exercises" / name
        assert (folder / "README.md").exists(), f"{name}: no README.md statement"
        starter = next(folder.glob("starter.*"))
        assert (ROOT / "exercises" / "solutions" / name / starter.name).exists(), f"{name}: no solution {starter.name}"


@pytest.mark.parametrize("name", NAMES)
def test_starter_fails(starters, name):
    results, output = starters
    r = results[name]
    assert r["tests"], f"{name}: the grader ran no test on the starter\n{output[-3000:]}"
    assert r["failed"] > 0, f"{name}: the grader passes the untouched starter: {r['tests']}"
    assert not grade.verdict(r).startswith("PASS"), grade.verdict(r)
    if name == CUDA_EXERCISE and not torch.cuda.is_available() and not HAS_CXX:
        assert grade.verdict(r).startswith("NOT GRADED"), grade.verdict(r)


@pytest.mark.parametrize("name", NAMES)
def test_solution_passes(solutions, name):
    results, output = solutions
    r = results[name]
    assert r["tests"], f"{name}: the grader ran no test on the solution\n{output[-3000:]}"
    if name == CUDA_EXERCISE and not torch.cuda.is_available() and not HAS_CXX:
        assert grade.verdict(r).startswith("NOT GRADED"), grade.verdict(r)
        pytest.skip(f"{name}: no GPU and no C++ compiler: the solution's kernel could not run (NOT GRADED)")
    assert r["failed"] == 0, f"{name}: the grader fails the solution: {r['tests']}\n{output[-6000:]}"
    assert grade.verdict(r).startswith("PASS"), grade.verdict(r)
    if name == CUDA_EXERCISE:
        ran = [t for t, outcome in r["tests"].items() if t.startswith("test_matches") and outcome == "passed"]
        assert ran, f"{name}: the solution's kernel ran nowhere: {r['tests']}"
        if r["skipped"]:
            pytest.skip(f"{name}: passed where it could run; not run here: " + "; ".join(r["skip_reasons"]))
    else:
        assert r["passed"] > 0 and r["skipped"] == 0, f"{name}: {r['tests']}"


def test_summary_never_passes_what_did_not_run():
    skipped_only = dict(passed=0, failed=0, skipped=3, tests={"a": "skipped"}, skip_reasons=["the GPU run"],
                        not_graded=[])
    not_graded = dict(passed=1, failed=1, skipped=2, tests={"a": "passed", "b": "failed"}, skip_reasons=[],
                      not_graded=["NOT GRADED: no CUDA GPU and no C++ compiler"])
    assert grade.verdict(skipped_only).startswith("NOT GRADED")
    assert grade.verdict(not_graded).startswith("NOT GRADED")
