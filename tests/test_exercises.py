"""The exercises' graders work: each FAILS on its untouched starter and PASSES on its solution.

Runs exercises/grade.py's graders in two pytest processes (starters, then solutions with
FLASH_EXERCISE_SOLUTIONS=1). Without a GPU the CUDA exercise's kernel checks skip; its nvcc compile
check of the solution still runs (and skips, visibly, when nvcc is missing).
"""
import importlib.util
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


@pytest.fixture(scope="module")
def starters():
    results, output, _ = grade.run(EXERCISES, solutions=False, pytest_args=["--tb=no"], quiet=True)
    return results, output


@pytest.fixture(scope="module")
def solutions():
    results, output, _ = grade.run(EXERCISES, solutions=True, pytest_args=["--tb=short"], quiet=True)
    return results, output


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
    gpu_tests = [t for t in r["tests"] if t != COMPILE_TEST] if name == CUDA_EXERCISE else []
    if gpu_tests and not torch.cuda.is_available():
        assert all(r["tests"][t] == "skipped" for t in gpu_tests), r["tests"]
        pytest.skip(f"{name}: no GPU, so the starter's kernel cannot be shown to fail (its GPU tests skipped)")
    assert r["failed"] > 0, f"{name}: the grader passes the untouched starter: {r['tests']}"


@pytest.mark.parametrize("name", NAMES)
def test_solution_passes(solutions, name):
    results, output = solutions
    r = results[name]
    assert r["tests"], f"{name}: the grader ran no test on the solution\n{output[-3000:]}"
    assert r["failed"] == 0, f"{name}: the grader fails the solution: {r['tests']}\n{output[-6000:]}"
    if name == CUDA_EXERCISE:
        if r["tests"].get(COMPILE_TEST) == "skipped":
            pytest.skip(f"{name}: nvcc not found, the solution's compile check was skipped")
        assert r["tests"].get(COMPILE_TEST) == "passed", r["tests"]
        if not torch.cuda.is_available():
            pytest.skip(f"{name}: the solution compiles with nvcc; no GPU, so its kernel was not run")
    else:
        assert r["passed"] > 0 and r["skipped"] == 0, f"{name}: {r['tests']}"
