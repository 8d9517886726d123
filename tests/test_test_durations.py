"""scripts/test_durations.py: a pytest JUnit report as the per-file and slowest-test tables."""

import pytest

from scripts.test_durations import by_file, main, markdown, read_junit

REPORT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="test_one" time="10.0"/>
<testcase classname="tests.test_a" name="test_two" time="2.5"><skipped message="no postgres"/></testcase>
<testcase classname="tests.test_b.TestGroup" name="test_three[x]" time="30.0"><failure message="boom"/></testcase>
<testcase classname="tests.test_c" name="test_four" time="7.5"/>
</testsuite></testsuites>"""


def test_cases_are_grouped_by_file_slowest_first(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(REPORT)
    cases = read_junit(path)
    assert cases[2] == ("tests/test_b.py", "test_three[x]", 30.0, "failed") and cases[1][3] == "skipped"
    assert by_file(cases) == {"tests/test_b.py": (1, 30.0), "tests/test_a.py": (2, 12.5), "tests/test_c.py": (1, 7.5)}
    text = markdown(cases, top=2)
    assert "| `tests/test_b.py` | 1 | 30 | 60.0 % |" in text and "| all | 4 | 50 | 100 % |" in text
    assert text.split("slowest tests:")[1].count("| `tests/") == 2


def test_before_and_after_side_by_side(tmp_path):
    before, after = tmp_path / "before.xml", tmp_path / "after.xml"
    before.write_text(REPORT)
    after.write_text(REPORT.replace('time="30.0"', 'time="12.0"'))
    out = tmp_path / "table.md"
    assert main([str(after), "--before", str(before), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| `tests/test_b.py` | 1 | 30 | 1 | 12 | -18 |" in text and "| all | 4 | 50 | 4 | 32 | -18 |" in text


def test_a_file_that_is_no_report_is_named(tmp_path, capsys):
    bad = tmp_path / "notes.txt"
    bad.write_text("not xml")
    assert main([str(bad)]) == 2
    assert "notes.txt: not a readable JUnit XML report" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no test cases"):
        (tmp_path / "empty.xml").write_text("<testsuites/>")
        read_junit(tmp_path / "empty.xml")
