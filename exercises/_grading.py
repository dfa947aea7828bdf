"""What every grader shares: which answer file to grade, how to import it, which of reference.py's functions it
may not call, and how to report a mismatch.

A grader in exercises/<NN_name>/ grades the student's file in that folder (starter.py or starter.cu).
With FLASH_EXERCISE_SOLUTIONS=1 in the environment it grades exercises/solutions/<NN_name>/ instead,
the same file names: that is how CI proves each grader passes on a correct answer.

Reports: a failing check lists every quantity it compared (right ones too), so that, say, a wrong l_i
update (L and O wrong) is told apart from a wrong O_i update (O wrong, L right); then the likely causes
that the grader could recognise, each found by comparing the answer with what that mistake produces.
"""
import importlib.util
import os
import sys
from pathlib import Path

EXERCISES = Path(__file__).resolve().parent
ROOT = EXERCISES.parent                      # the repository root: reference.py, bench.py, flash.cu
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))            # so answers and graders can `import reference`

SOLUTIONS_VARIABLE = "FLASH_EXERCISE_SOLUTIONS"


def grading_solutions():
    return os.environ.get(SOLUTIONS_VARIABLE, "") not in ("", "0")


def answer_path(grader_file, name="starter.py"):
    """The file to grade: the student's copy next to the grader, or the instructor's solution."""
    exercise = Path(grader_file).resolve().parent
    base = EXERCISES / "solutions" / exercise.name if grading_solutions() else exercise
    path = base / name
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (graded: {'solution' if grading_solutions() else 'starter'}; "
                                f"unset {SOLUTIONS_VARIABLE} to grade your own file)")
    return path


def load_answer(grader_file, name="starter.py"):
    """Import the answer file as a module, fresh, under a name that says which file it is."""
    path = answer_path(grader_file, name)
    module_name = f"answer_{path.parent.name}_{'solution' if grading_solutions() else 'starter'}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refuse_calls(monkeypatch, answer, module, names, who, why):
    """Make the functions `names` of `module` (reference.py) raise for the rest of a test, whether the answer calls
    them through the module or through a name it bound on loading (`from reference import merge`, or
    `merge = reference.merge`): the exercise is to write them."""
    for name in names:
        original = getattr(module, name, None)
        if original is None:
            continue

        def refuse(*args, _name=name, **kwargs):
            raise AssertionError(f"{who} must not call {module.__name__}.{_name}: {why}")
        monkeypatch.setattr(module, name, refuse)
        for bound, value in list(vars(answer).items()):
            if value is original:
                monkeypatch.setattr(answer, bound, refuse)


# ---- comparing numbers ---------------------------------------------------------------------------------

def close(got, expected, rel=1e-9):
    """True if `got` is a number (not a bool) within `rel` of `expected`, relatively (absolutely near 0)."""
    return (isinstance(got, (int, float)) and not isinstance(got, bool)
            and abs(got - expected) <= rel * abs(expected) + 1e-12)


# ---- comparing tensors and saying what differs ------------------------------------------------------

def _index(flat, shape):
    out = []
    for size in reversed(shape):
        out.append(flat % size)
        flat //= size
    return tuple(reversed(out))


def mismatch(name, got, expected, tol):
    """None if `got` equals `expected` to `tol` (absolute, NaN-aware), else one line saying where and how."""
    import torch
    if not isinstance(got, torch.Tensor):
        return f"{name}: expected a tensor of shape {tuple(expected.shape)}, got {type(got).__name__}"
    if tuple(got.shape) != tuple(expected.shape):
        return f"{name}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    if got.numel() == 0:
        return None
    got, expected = got.detach().double().cpu(), expected.detach().double().cpu()
    bad_got = ~torch.isfinite(got) & torch.isfinite(expected)
    if bad_got.any():
        k = int(bad_got.sum())
        first = _index(int(bad_got.flatten().nonzero()[0]), got.shape)
        return (f"{name}: {k} of {got.numel()} entries are inf/NaN where the answer is finite, first at index "
                f"{first} (got {got[first].item()}, expected {expected[first].item():.6g})")
    same_inf = (got == expected) & ~torch.isfinite(expected)                   # -inf == -inf is right
    err = torch.where(same_inf, torch.zeros_like(got), (got - expected).abs())
    err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
    worst = float(err.max())
    if worst <= tol:
        return None
    where = _index(int(err.flatten().argmax()), got.shape)
    return (f"{name}: max error {worst:.3g} (tolerance {tol:g}) at index {where}: expected "
            f"{expected[where].item():.8g}, got {got[where].item():.8g}")


def matches(got, expected, tol):
    return mismatch("", got, expected, tol) is None


def check_all(what, checks, causes=()):
    """Compare every (name, got, expected, tol) in `checks`; if any differs, fail with one line per
    quantity (right ones marked right) and then the recognised likely causes (strings; empty ones are
    dropped)."""
    lines, wrong = [], False
    for name, got, expected, tol in checks:
        problem = mismatch(name, got, expected, tol)
        wrong |= problem is not None
        lines.append(problem or f"{name}: right")
    if wrong:
        causes = [c for c in causes if c]
        text = what + "\n  " + "\n  ".join(lines)
        if causes:
            text += "\nlikely cause:\n  " + "\n  ".join(causes)
        raise AssertionError(text)
