"""What every grader shares: which answer file to grade, and how to import it.

A grader in exercises/<NN_name>/ grades the student's file in that folder (starter.py or starter.cu).
With FLASH_EXERCISE_SOLUTIONS=1 in the environment it grades exercises/solutions/<NN_name>/ instead,
the same file names: that is how CI proves each grader passes on a correct answer.
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
