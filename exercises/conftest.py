"""pytest settings for the graders (python exercises/grade.py, or pytest on an exercise folder).

A failing check is reported as its message alone: the grader's message already says which input,
which quantity, what was expected and what came back, and pytest's own view of the failing line
(source, locals, tensor dumps) would bury it. An exception raised by the answer file is reported as
its type, its message and the line of the answer file it came from.
"""
import os

import pytest


def _answer_frame(excinfo):
    """'starter.py:42: <source line>' of the innermost traceback entry inside an answer file, or ''."""
    for entry in reversed(excinfo.traceback):
        path = str(entry.path)
        if path.endswith(("starter.py", "starter.cu")):
            try:
                source = str(entry.statement).strip()
            except Exception:  # noqa: BLE001 (no source available: say where only)
                source = ""
            return f"{os.path.relpath(path)}:{entry.lineno + 1}: {source}"
    return ""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed or call.excinfo is None:
        return
    if item.config.getoption("tbstyle") == "long":
        return                                  # asked for pytest's own report
    error = call.excinfo.value
    if isinstance(error, AssertionError):
        report.longrepr = str(error)
    elif isinstance(error, NotImplementedError):
        report.longrepr = f"not written yet: {error} (raised at {_answer_frame(call.excinfo) or 'the answer file'})"
    else:
        where = _answer_frame(call.excinfo)
        report.longrepr = (f"{type(error).__name__}: {error}" + (f"\n  raised at {where}" if where else "")
                           + "\n  (run the grader with --tb=long for the whole traceback)")
