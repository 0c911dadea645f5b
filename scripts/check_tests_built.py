#!/usr/bin/env python3
"""Every GoogleTest source under tests/ is built: each tests/**/X_test.cc is named in the
CMakeLists.txt of its folder. A test file that no CMakeLists names compiles nowhere and runs
never, and nothing else notices (a merge once emptied tests/unit/runtime/CMakeLists.txt and
seven test programs silently stopped running).

  check_tests_built.py SOURCE_DIR      exit 0 when every test file is built, 1 listing those not
  check_tests_built.py --self-test     the check finds an unlisted file in a scratch tree
"""
import pathlib
import sys
import tempfile


def unbuilt(root: pathlib.Path) -> list[str]:
    missing = []
    for test in sorted((root / "tests").rglob("*_test.cc")):
        cmake = test.parent / "CMakeLists.txt"
        text = cmake.read_text() if cmake.exists() else ""
        if test.name not in text:
            missing.append(str(test.relative_to(root)))
    return missing


def self_test() -> int:
    with tempfile.TemporaryDirectory() as d:
        root = pathlib.Path(d)
        (root / "tests" / "unit" / "a").mkdir(parents=True)
        (root / "tests" / "unit" / "a" / "x_test.cc").write_text("")
        (root / "tests" / "unit" / "a" / "y_test.cc").write_text("")
        (root / "tests" / "unit" / "a" / "CMakeLists.txt").write_text(
            "vp_add_test(x_test SOURCES x_test.cc)\n")
        found = unbuilt(root)
        if found != ["tests/unit/a/y_test.cc"]:
            print(f"self-test: expected the unlisted y_test.cc, got {found}")
            return 1
    print("self-test: the check finds a test file no CMakeLists.txt names")
    return 0


def main() -> int:
    if len(sys.argv) == 2 and sys.argv[1] == "--self-test":
        return self_test()
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    missing = unbuilt(pathlib.Path(sys.argv[1]))
    for m in missing:
        print(f"{m}: no CMakeLists.txt in its folder names it, so it is never built or run")
    if not missing:
        print("every tests/**/*_test.cc is named in its folder's CMakeLists.txt")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
