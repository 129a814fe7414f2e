#!/usr/bin/env python3
"""Every C++ block of README.md and docs/ compiles against the headers as they are now.

Usage: test_doc_snippets.py SOURCE_ROOT BUILD_ROOT

A block is a fragment of a program, so the line before its fence says what it assumes:

    <!-- compiled with: std::shared_ptr<nn::Module> model, Tensor loss -->
    ```cpp
    ...
    ```

Each block becomes the body of a function taking those parameters, in one file with
`#include <nanoddp/nanoddp.h>` and `using namespace nanoddp;`, compiled with the flags the build
gives tests/test_docs.cpp (from BUILD_ROOT/compile_commands.json), `-fsyntax-only`. #line
directives point the compiler's errors at the Markdown file and line. A block that is not a
fragment (pseudocode, an excerpt of a file compiled elsewhere) says so instead:

    <!-- not compiled: pseudocode of the ring's two phases -->

A block with neither fails the test, naming its file and line.
"""

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

FENCE = re.compile(r"^```(cpp|c\+\+)\s*$")
COMPILED_WITH = re.compile(r"^<!-- compiled with:(.*)-->\s*$")
NOT_COMPILED = re.compile(r"^<!-- not compiled: .+-->\s*$")


def markdown_files(source_root):
    yield "README.md"
    for folder, _, names in sorted(os.walk(os.path.join(source_root, "docs"))):
        for name in sorted(names):
            if name.endswith(".md"):
                yield os.path.relpath(os.path.join(folder, name), source_root)


def snippets(source_root, relative):
    """(first code line number, parameters or None when not compiled, code lines) per block."""
    lines = open(os.path.join(source_root, relative), encoding="utf-8").read().splitlines()
    found, problems = [], []
    i = 0
    while i < len(lines):
        if not FENCE.match(lines[i]):
            i += 1
            continue
        before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        end = next((k for k in range(i + 1, len(lines)) if lines[k].startswith("```")), len(lines))
        code = lines[i + 1:end]
        compiled = COMPILED_WITH.match(before)
        if compiled:
            found.append((i + 2, compiled.group(1).strip(), code))
        elif not NOT_COMPILED.match(before):
            problems.append(f"{relative}:{i + 1}: a C++ block needs '<!-- compiled with: PARAMETERS -->' "
                            "or '<!-- not compiled: REASON -->' on the line before its fence")
        i = end + 1
    return found, problems


def compile_command(build_root):
    """The build's command for tests/test_docs.cpp, made a syntax check of one other file."""
    entries = json.load(open(os.path.join(build_root, "compile_commands.json"), encoding="utf-8"))
    entry = next(e for e in entries if e["file"].endswith("tests/test_docs.cpp"))
    args = shlex.split(entry["command"])
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("-o", "-MQ", "-MF", "-MT"):
            skip = True
        elif arg in ("-c", "-MD") or arg.endswith("test_docs.cpp"):
            pass
        else:
            kept.append(arg)
    # A fragment need not use every parameter it is given.
    return kept + ["-fsyntax-only", "-fdiagnostics-color=never", "-Wno-unused-parameter", "-Wno-unused-variable"], entry["directory"]


def main():
    source_root, build_root = (os.path.abspath(a) for a in sys.argv[1:3])
    problems, units = [], []
    for relative in markdown_files(source_root):
        found, missing = snippets(source_root, relative)
        problems += missing
        units += [(relative, line, params, code) for line, params, code in found]
    if problems:
        print("\n".join(problems))
        return 1
    parts = ["#include <nanoddp/nanoddp.h>", "#include <functional>", "#include <memory>", "#include <utility>",
             "#include <vector>", "using namespace nanoddp;"]
    for k, (relative, line, params, code) in enumerate(units):
        path = os.path.join(source_root, relative)
        parts.append(f"[[maybe_unused]] static void snippet_{k}({params}) {{")
        parts.append(f'#line {line} "{path}"')
        parts += code
        parts.append("}")
    command, directory = compile_command(build_root)
    command.append("-I" + os.path.join(source_root, "include"))  # <nanoddp/...>, as an installed nanoddp
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", delete=False) as unit:
        unit.write("\n".join(parts) + "\n")
    try:
        result = subprocess.run(command + [unit.name], cwd=directory, capture_output=True, text=True)
    finally:
        os.unlink(unit.name)
    if result.returncode != 0:
        print(result.stdout + result.stderr)
        print(f"FAIL: a C++ block of the docs does not compile (of {len(units)} blocks)")
        return 1
    print(f"{len(units)} C++ blocks of README.md and docs/ compile")
    return 0


if __name__ == "__main__":
    sys.exit(main())
