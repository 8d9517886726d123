from pathlib import Path

import trace


def test_import_trace_resolves_to_this_project_not_the_standard_library():
    assert getattr(trace, "IS_TRACE_PROJECT", False)
    assert Path(trace.__file__).resolve().parent == Path(__file__).resolve().parents[1] / "trace"


def test_core_modules_import_without_torch_deepspeed_or_vllm():
    import subprocess
    import sys

    code = ("import sys, trace.tree, trace.tree_io, trace.configuration.config, trace.envs.base; "
            "bad = [m for m in ('torch', 'deepspeed', 'vllm') if m in sys.modules]; "
            "assert not bad, bad")
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)
