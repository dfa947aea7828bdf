"""Writes docs/algorithm.md from docs/algorithm.md.in, turning each {file:function:pattern|pattern...}
into links to the lines of that function that carry the pattern: l.N (the paper's line, as tagged in a
comment) or "a piece of code". Run it after editing flash.cu, reference.py or main.py:

    python docs/make_algorithm.py            # rewrite docs/algorithm.md
    python docs/make_algorithm.py --check    # exit 1 if docs/algorithm.md is out of date
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ("flash.cu", "reference.py", "main.py")


def function_lines(lines, file, function):
    """(start, end) line indices of a function ('*': the whole file)."""
    if function == "*":
        return 0, len(lines)
    if file.endswith(".py"):
        start = next(i for i, line in enumerate(lines) if line.startswith(f"def {function}("))
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("def ")), len(lines))
        return start, end
    start = next(i for i, line in enumerate(lines) if re.match(rf"(__global__ |__device__ )?(inline )?([\w:<>]+ )?{function}\(", line))
    return start, next(i for i in range(start, len(lines)) if lines[i] == "}") + 1


def matching_lines(lines, file, function, pattern):
    """1-based numbers of the lines that hold "code" or whose comment holds the tag l.N."""
    start, end = function_lines(lines, file, function)
    found = []
    for i in range(start, end):
        line = lines[i]
        if pattern.startswith('"'):
            hit = pattern.strip('"') in line
        else:
            marker = "#" if file.endswith(".py") else "//"
            comment = line.split(marker, 1)[1] if marker in line else ""
            hit = re.search(r"\b" + re.escape(pattern) + r"\b", comment)
        if hit:
            found.append(i + 1)
    if not found:
        sys.exit(f"make_algorithm.py: {file}:{function}: nothing matches {pattern}")
    return found


def render(template):
    sources = {f: (ROOT / f).read_text().split("\n") for f in SOURCES}

    def links(match):
        file, function, patterns = match.groups()
        numbers = []
        for pattern in patterns.split("|"):
            numbers += [n for n in matching_lines(sources[file], file, function, pattern) if n not in numbers]
        return ", ".join(f"[L{n}](../{file}#L{n})" for n in numbers)

    page = re.sub(r"\{(flash\.cu|reference\.py|main\.py):(\w+|\*):([^{}]+)\}", links, template)
    if left := re.search(r"\{(flash\.cu|reference\.py|main\.py):[^\n]*", page):  # a pattern with a brace in it
        sys.exit(f"make_algorithm.py: a link was not made (a pattern cannot hold braces): {left.group()[:80]}")
    return page


if __name__ == "__main__":
    page = render((ROOT / "docs" / "algorithm.md.in").read_text())
    target = ROOT / "docs" / "algorithm.md"
    if "--check" in sys.argv:
        sys.exit(0 if target.read_text() == page else "docs/algorithm.md is out of date: run python docs/make_algorithm.py")
    target.write_text(page)
