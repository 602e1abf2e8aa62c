"""The allocator a lab process on a GPU asks for (`kitty_core.allocator`)."""

import os
import subprocess
import sys

from kitty_core.allocator import LAB_COMMAND, gpu_lab_note, lab_environment, pymalloc_in_use


def test_pymalloc_is_the_default_and_the_c_library_allocator_replaces_it():
    assert pymalloc_in_use({})
    assert pymalloc_in_use({"PYTHONMALLOC": "pymalloc"})
    assert not pymalloc_in_use({"PYTHONMALLOC": "malloc"})
    assert not pymalloc_in_use({"PYTHONMALLOC": "malloc_debug"})
    assert lab_environment({"PATH": "/bin"}) == {"PATH": "/bin", "PYTHONMALLOC": "malloc"}
    assert lab_environment({"PYTHONMALLOC": "pymalloc_debug"}) == {"PYTHONMALLOC": "malloc_debug"}  # hooks kept
    assert lab_environment({"PYTHONMALLOC": "malloc"}) == {"PYTHONMALLOC": "malloc"}


def test_the_lab_names_the_command_only_on_a_gpu_with_pymalloc():
    note = gpu_lab_note("cuda", {})
    assert note and LAB_COMMAND in note and LAB_COMMAND.startswith("PYTHONMALLOC=malloc ")
    assert gpu_lab_note("cpu", {}) is None
    assert gpu_lab_note("cuda", {"PYTHONMALLOC": "malloc"}) is None


def test_a_process_started_with_the_lab_environment_runs_without_pymalloc():
    probe = "import sys; sys._debugmallocstats()"  # reports pymalloc's arenas only when pymalloc is in use
    plain = {k: v for k, v in os.environ.items() if k != "PYTHONMALLOC"}
    for env, pymalloc in ((lab_environment(plain), False), (plain, True)):
        err = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stderr
        assert ("arenas" in err) == pymalloc, err[:300]
